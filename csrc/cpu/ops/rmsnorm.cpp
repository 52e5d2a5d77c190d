// CPU RMSNorm (+ fused residual add). Contract: csrc/ops/rmsnorm.h.
#include "cpu/kernels.h"
#include "cpu/vec.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

template <typename T>
void rmsnorm_row(const RMSNormParams& p, int64_t r) {
  const int64_t n = p.hidden;
  const T* x = static_cast<const T*>(p.x) + r * p.x_stride;
  const T* w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + r * p.out_stride;
  const T* src = x;  // the row that gets normalized
  float sum_sq = 0.f;
  if (p.residual != nullptr) {
    T* res = static_cast<T*>(p.residual) + r * p.residual_stride;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < n; ++i) {
      const T s = from_f32<T>(to_f32(x[i]) + to_f32(res[i]));
      res[i] = s;
      const float sf = to_f32(s);
      sum_sq += sf * sf;
    }
    src = res;
  } else {
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < n; ++i) {
      const float v = to_f32(x[i]);
      sum_sq += v * v;
    }
  }
  const float inv_rms = 1.f / __builtin_sqrtf(sum_sq / float(n) + p.eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_f32<T>(to_f32(src[i]) * inv_rms * to_f32(w[i]));
}

}  // namespace

void rmsnorm(const RMSNormParams& p) {
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_row(p.n_rows, p.n_rows * p.hidden >= kParallelMinElems, [&](int64_t r) { rmsnorm_row<T>(p, r); });
  });
}

}  // namespace kog::cpu::KOG_ISA_NS
