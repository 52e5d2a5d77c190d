// GPU rotary position embedding, in place on q and k. Contract: csrc/ops/rope.h; launcher: rope.cu.
// One block per token: the token's cos/sin table goes to shared memory once, then the block's
// threads rotate every (head, pair) of q and k. Math in fp32, one rounding per stored value.
#pragma once
#include "gpu/compat.cuh"

namespace kog::gpu {

// Largest rotary_dim / 2 (the bindings cap rotary_dim at 512).
constexpr int kRopeMaxHalf = 256;
constexpr int kRopeMaxThreads = 512;

// q: [n_tokens = gridDim.x, n_q_heads, head_dim] at token stride q_stride; k likewise or null;
// positions: [n_tokens]; inv_freq: [half]. Pair i of a head is (i, i + half) when is_neox,
// else (2i, 2i + 1); dimensions >= 2 * half are untouched.
template <typename T, typename Pos>
__global__ void __launch_bounds__(kRopeMaxThreads)
rope_kernel(T* q, T* k, const Pos* positions, const float* inv_freq, int n_q_heads,
            int n_kv_heads, int head_dim, int half, int64_t q_stride, int64_t k_stride,
            float attention_scaling, bool is_neox) {
  __shared__ float cos_s[kRopeMaxHalf], sin_s[kRopeMaxHalf];
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);  // accurate sincosf: |angle| reaches ~1e5 rad
    cos_s[i] = c * attention_scaling;
    sin_s[i] = s * attention_scaling;
  }
  __syncthreads();

  const int q_pairs = n_q_heads * half;
  const int all_pairs = q_pairs + n_kv_heads * half;
  const int step = is_neox ? half : 1;
  for (int w = threadIdx.x; w < all_pairs; w += blockDim.x) {
    const bool in_q = w < q_pairs;
    const int hw = in_q ? w : w - q_pairs;
    const int h = hw / half, i = hw % half;
    T* a = (in_q ? q + t * q_stride : k + t * k_stride) + h * head_dim + (is_neox ? i : 2 * i);
    T* b = a + step;
    const float af = load_f32(a), bf = load_f32(b);
    store_f32(a, af * cos_s[i] - bf * sin_s[i]);
    store_f32(b, bf * cos_s[i] + af * sin_s[i]);
  }
}

}  // namespace kog::gpu
