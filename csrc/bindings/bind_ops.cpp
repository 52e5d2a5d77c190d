// Op entry points. Tensors arrive as raw addresses plus sizes, already validated by the typed
// wrappers in kog/ops.py; the checks here guard the native code against a direct caller.
// device < 0 runs the CPU kernels; device >= 0 enqueues the GPU kernel on `stream`.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/errors.h"
#include "cpu/kernels.h"
#include "gpu/launch.h"

namespace py = pybind11;
using kog::DType;

namespace {

DType float_dtype(int code) {
  const DType t = static_cast<DType>(code);
  KOG_CHECK(code >= 0 && code <= 2, "dtype code ", code, " is not float32/float16/bfloat16");
  return t;
}

template <typename P>
void run(const P& p, int64_t device, uintptr_t stream, void (*cpu_fn)(const P&),
         void (*gpu_fn)(const P&, void*)) {
  if (device < 0) {
    cpu_fn(p);
    return;
  }
  KOG_CHECK_KIND(gpu_fn != nullptr, kBackend,
                 "this kog build has no GPU backend (built with KOG_BACKEND=", KOG_BACKEND_NAME, ")");
  gpu_fn(p, reinterpret_cast<void*>(stream));
}

#ifdef KOG_WITH_GPU
constexpr auto kGpuRmsnorm = &kog::gpu::rmsnorm;
constexpr auto kGpuRope = &kog::gpu::rope;
constexpr auto kGpuSiluAndMul = &kog::gpu::silu_and_mul;
#else
constexpr void (*kGpuRmsnorm)(const kog::RMSNormParams&, void*) = nullptr;
constexpr void (*kGpuRope)(const kog::RopeParams&, void*) = nullptr;
constexpr void (*kGpuSiluAndMul)(const kog::SiluAndMulParams&, void*) = nullptr;
#endif

void rmsnorm(uintptr_t out, uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t n_rows,
             int64_t hidden, int64_t x_stride, int64_t out_stride, int64_t residual_stride,
             float eps, int dtype, int64_t device, uintptr_t stream) {
  KOG_CHECK(n_rows >= 0 && hidden > 0, "rmsnorm: bad shape [", n_rows, ", ", hidden, "]");
  KOG_CHECK(n_rows == 0 || (out && x && weight), "rmsnorm: null tensor");
  KOG_CHECK(eps >= 0.f, "rmsnorm: eps must be >= 0, got ", eps);
  kog::RMSNormParams p{reinterpret_cast<void*>(out), reinterpret_cast<const void*>(x),
                       reinterpret_cast<void*>(residual), reinterpret_cast<const void*>(weight),
                       n_rows, hidden, x_stride, out_stride, residual_stride, eps,
                       float_dtype(dtype)};
  if (n_rows == 0) return;
  run(p, device, stream, kog::cpu::kernels().rmsnorm, kGpuRmsnorm);
}

void rope(uintptr_t q, uintptr_t k, uintptr_t positions, uintptr_t inv_freq, int64_t n_tokens,
          int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim, int64_t rotary_dim,
          int64_t q_stride, int64_t k_stride, float attention_scaling, bool is_neox, int dtype,
          int pos_dtype, int64_t device, uintptr_t stream) {
  KOG_CHECK(n_tokens >= 0 && n_q_heads > 0 && head_dim > 0, "rope: bad shape");
  KOG_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim && rotary_dim <= 512,
            "rope: rotary_dim must be even, in (0, min(head_dim, 512)], got ", rotary_dim);
  KOG_CHECK(pos_dtype == int(DType::kI32) || pos_dtype == int(DType::kI64),
            "rope: positions must be int32 or int64");
  KOG_CHECK(n_tokens == 0 || (q && positions && inv_freq), "rope: null tensor");
  kog::RopeParams p{reinterpret_cast<void*>(q), reinterpret_cast<void*>(k),
                    reinterpret_cast<const void*>(positions),
                    reinterpret_cast<const float*>(inv_freq), n_tokens, n_q_heads,
                    k ? n_kv_heads : 0, head_dim, rotary_dim, q_stride, k_stride,
                    attention_scaling, is_neox, float_dtype(dtype), static_cast<DType>(pos_dtype)};
  if (n_tokens == 0) return;
  run(p, device, stream, kog::cpu::kernels().rope, kGpuRope);
}

void silu_and_mul(uintptr_t out, uintptr_t x, int64_t n_rows, int64_t d, int64_t x_stride,
                  int64_t out_stride, int dtype, int64_t device, uintptr_t stream) {
  KOG_CHECK(n_rows >= 0 && d > 0, "silu_and_mul: bad shape [", n_rows, ", ", 2 * d, "]");
  KOG_CHECK(n_rows == 0 || (out && x), "silu_and_mul: null tensor");
  kog::SiluAndMulParams p{reinterpret_cast<void*>(out), reinterpret_cast<const void*>(x), n_rows,
                          d, x_stride, out_stride, float_dtype(dtype)};
  if (n_rows == 0) return;
  run(p, device, stream, kog::cpu::kernels().silu_and_mul, kGpuSiluAndMul);
}

}  // namespace

void bind_ops(py::module_& m) {
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rmsnorm", &rmsnorm, arg("out"), arg("x"), arg("residual"), arg("weight"), arg("n_rows"),
        arg("hidden"), arg("x_stride"), arg("out_stride"), arg("residual_stride"), arg("eps"),
        arg("dtype"), arg("device"), arg("stream"), nogil);
  m.def("rope", &rope, arg("q"), arg("k"), arg("positions"), arg("inv_freq"), arg("n_tokens"),
        arg("n_q_heads"), arg("n_kv_heads"), arg("head_dim"), arg("rotary_dim"), arg("q_stride"),
        arg("k_stride"), arg("attention_scaling"), arg("is_neox"), arg("dtype"), arg("pos_dtype"),
        arg("device"), arg("stream"), nogil);
  m.def("silu_and_mul", &silu_and_mul, arg("out"), arg("x"), arg("n_rows"), arg("d"),
        arg("x_stride"), arg("out_stride"), arg("dtype"), arg("device"), arg("stream"), nogil);
}
