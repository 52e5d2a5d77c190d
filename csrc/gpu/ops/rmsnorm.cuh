// GPU RMSNorm (+ fused residual add). Contract: csrc/ops/rmsnorm.h; launcher: rmsnorm.cu.
// One block per row: pass 1 (adds the residual and) sums squares, a block reduction gives the
// row's 1/rms, pass 2 scales by it and the weight. Math in fp32, one rounding per stored value.
#pragma once
#include "gpu/compat.cuh"

namespace kog::gpu {

// out, x, residual: [n_rows = gridDim.x, hidden] rows at their strides; weight: [hidden].
// Thread t owns the N-element chunks t, t + blockDim.x, ... of its row in both passes, so the
// residual it stores in pass 1 is re-read by the same thread in pass 2. With N > 1 every row
// start is 16-byte aligned and hidden % N == 0 (the launcher checks). out may alias x.
// Largest block the launcher uses (one thread per N-element chunk, up to this many).
constexpr int kRmsnormMaxThreads = kMaxBlockThreads;

template <typename T, int N>
__global__ void __launch_bounds__(kRmsnormMaxThreads)
rmsnorm_kernel(T* out, const T* x, T* residual, const T* weight, int64_t hidden,
               int64_t x_stride, int64_t out_stride, int64_t residual_stride, float eps) {
  using V = Vec<T, N>;
  const int64_t row = blockIdx.x;
  const int64_t n_chunks = hidden / N;
  const V* xv = reinterpret_cast<const V*>(x + row * x_stride);
  V* rv = residual ? reinterpret_cast<V*>(residual + row * residual_stride) : nullptr;
  float sum_sq = 0.f;
  for (int64_t c = threadIdx.x; c < n_chunks; c += blockDim.x) {
    const V a = xv[c];
    if (rv) {
      V s = rv[c];
#pragma unroll
      for (int j = 0; j < N; ++j) {
        gpu_from_float(gpu_to_float(a.v[j]) + gpu_to_float(s.v[j]), s.v[j]);
        const float f = gpu_to_float(s.v[j]);  // the rounded sum is what gets normalized
        sum_sq += f * f;
      }
      rv[c] = s;
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) sum_sq += gpu_to_float(a.v[j]) * gpu_to_float(a.v[j]);
    }
  }
  const float inv_rms = 1.f / sqrtf(block_reduce_sum(sum_sq) / float(hidden) + eps);

  const V* src = rv ? rv : xv;
  const V* wv = reinterpret_cast<const V*>(weight);
  V* ov = reinterpret_cast<V*>(out + row * out_stride);
  for (int64_t c = threadIdx.x; c < n_chunks; c += blockDim.x) {
    const V s = src[c], w = wv[c];
    V o;
#pragma unroll
    for (int j = 0; j < N; ++j)
      gpu_from_float(gpu_to_float(s.v[j]) * inv_rms * gpu_to_float(w.v[j]), o.v[j]);
    ov[c] = o;
  }
}

}  // namespace kog::gpu
