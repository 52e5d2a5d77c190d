// CPU SiLU-and-mul. Contract: csrc/ops/activation.h.
#include "cpu/kernels.h"
#include "cpu/vec.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

template <typename T>
void silu_and_mul_row(const SiluAndMulParams& p, int64_t r) {
  const T* gate = static_cast<const T*>(p.x) + r * p.x_stride;
  const T* up = gate + p.d;
  T* out = static_cast<T*>(p.out) + r * p.out_stride;
#pragma omp simd
  for (int64_t i = 0; i < p.d; ++i) {
    const float g = to_f32(gate[i]);
    out[i] = from_f32<T>(g / (1.f + fast_exp(-g)) * to_f32(up[i]));
  }
}

}  // namespace

void silu_and_mul(const SiluAndMulParams& p) {
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_row(p.n_rows, p.n_rows * p.d >= kParallelMinElems, [&](int64_t r) { silu_and_mul_row<T>(p, r); });
  });
}

}  // namespace kog::cpu::KOG_ISA_NS
