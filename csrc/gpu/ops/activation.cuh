// GPU SiLU-and-mul (SwiGLU gate). Contract: csrc/ops/activation.h; launcher: activation.cu.
// out = silu(gate) * up with silu(g) = g / (1 + exp(-g)); math in fp32, one rounding per value.
#pragma once
#include "gpu/compat.cuh"

namespace kog::gpu {

// x: [n_rows = gridDim.x, 2 * d] (gate half, then up half); out: [n_rows, d].
// Block (row, blockIdx.y) handles the N-element chunks blockIdx.y * blockDim.x + threadIdx.x.
// With N > 1 rows start 16-byte aligned and d % N == 0 (the launcher checks).
constexpr int kSiluMaxThreads = 256;

template <typename T, int N>
__global__ void __launch_bounds__(kSiluMaxThreads)
silu_and_mul_kernel(T* out, const T* x, int64_t d, int64_t x_stride, int64_t out_stride) {
  using V = Vec<T, N>;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= d / N) return;
  const T* row = x + static_cast<int64_t>(blockIdx.x) * x_stride;
  const V g = reinterpret_cast<const V*>(row)[c];
  const V u = reinterpret_cast<const V*>(row + d)[c];
  V o;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float gf = gpu_to_float(g.v[j]);
    gpu_from_float(gf / (1.f + expf(-gf)) * gpu_to_float(u.v[j]), o.v[j]);
  }
  reinterpret_cast<V*>(out + static_cast<int64_t>(blockIdx.x) * out_stride)[c] = o;
}

}  // namespace kog::gpu
