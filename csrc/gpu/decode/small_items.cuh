// The per-sequence work items of the persistent decode kernel: one item = one batch row b.
// Layouts: the schedule's buffers, [B, width] rows in the run dtype T; qkv rows hold
// [q heads | k heads | v heads], head_dim contiguous. Math in fp32, one rounding per store.
#pragma once
#include "gpu/decode/sync.cuh"
#include "gpu/decode/tuning.cuh"

namespace kog::gpu::decode {

// out[b] = embed[token[b]] (a row copy).
template <typename T>
__device__ void embed_item(const T* __restrict__ table, const int32_t* tokens, T* out, int64_t hidden, int b) {
  const T* src = table + int64_t(tokens[b]) * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) out[b * hidden + i] = src[i];
}

// With residual: residual[b] += x[b] (rounded to T), out[b] = rmsnorm(residual[b]) * w.
// Without: out[b] = rmsnorm(x[b]) * w. out may alias x.
template <typename T>
__device__ void rmsnorm_item(const T* x, T* residual, const T* __restrict__ w, T* out, int64_t width,
                             float eps, int b, float* scratch) {
  const T* xr = x + b * width;
  T* rr = residual != nullptr ? residual + b * width : nullptr;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    float v = gpu_to_float(xr[i]);
    if (rr != nullptr) {
      store_f32(rr + i, v + gpu_to_float(rr[i]));
      v = gpu_to_float(rr[i]);  // the rounded sum is what gets normalized
    }
    ss += v * v;
  }
  const float inv = 1.f / sqrtf(block_sum(ss, scratch) / float(width) + eps);
  const T* src = rr != nullptr ? rr : xr;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x)
    store_f32(out + b * width + i, gpu_to_float(src[i]) * inv * gpu_to_float(w[i]));
}

// Per-head RMSNorm of q heads (weight qw) and k heads (weight kw) of qkv row b; warp per head.
template <typename T>
__device__ void qk_norm_item(T* qkv, int64_t qkv_width, const T* __restrict__ qw, const T* __restrict__ kw,
                             int n_q, int n_kv, int hd, float eps, int b) {
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  for (int h = warp; h < n_q + n_kv; h += kWarps) {
    T* v = qkv + b * qkv_width + int64_t(h) * hd;
    const T* w = h < n_q ? qw : kw;
    float ss = 0.f;
    for (int d = lane; d < hd; d += KOG_WARP_SIZE) ss += gpu_to_float(v[d]) * gpu_to_float(v[d]);
    const float inv = 1.f / sqrtf(warp_reduce_sum(ss) / float(hd) + eps);
    for (int d = lane; d < hd; d += KOG_WARP_SIZE) store_f32(v + d, gpu_to_float(v[d]) * inv * gpu_to_float(w[d]));
  }
}

// Rotates the q and k heads of qkv row b at position pos (NeoX halves or GPT-J pairs).
template <typename T>
__device__ void rope_item(T* qkv, int64_t qkv_width, const float* __restrict__ inv_freq, int64_t pos,
                          int n_heads, int hd, int rotary_dim, bool neox, int b) {
  const int half = rotary_dim / 2;
  for (int t = threadIdx.x; t < n_heads * half; t += blockDim.x) {
    const int h = t / half, i = t % half;
    float s, c;
    sincosf(float(pos) * inv_freq[i], &s, &c);
    T* v = qkv + b * qkv_width + int64_t(h) * hd;
    T* pa = neox ? v + i : v + 2 * i;
    T* pb = neox ? v + i + half : v + 2 * i + 1;
    const float a = gpu_to_float(*pa), bb = gpu_to_float(*pb);
    store_f32(pa, a * c - bb * s);
    store_f32(pb, bb * c + a * s);
  }
}

// Copies the k and v heads of qkv row b into the layer's cache at `slot`.
// kv_layer: [num_blocks, 2, n_kv, block_size, hd].
template <typename T>
__device__ void kv_append_item(const T* qkv, int64_t qkv_width, T* kv_layer, int64_t slot, int n_q, int n_kv,
                               int hd, int block_size, int b) {
  const int64_t block = slot / block_size, off = slot % block_size;
  const T* k = qkv + b * qkv_width + int64_t(n_q) * hd;
  const T* v = k + int64_t(n_kv) * hd;
  for (int t = threadIdx.x; t < n_kv * hd; t += blockDim.x) {
    const int h = t / hd, d = t % hd;
    const int64_t ko = ((block * 2 + 0) * n_kv + h) * block_size * hd + off * hd + d;
    const int64_t vo = ((block * 2 + 1) * n_kv + h) * block_size * hd + off * hd + d;
    kv_layer[ko] = k[t];
    kv_layer[vo] = v[t];
  }
}

// act[b] = silu(gate[b]) * up[b]; gate_up row = [gate | up], each `inter` wide.
template <typename T>
__device__ void silu_mul_item(const T* gate_up, T* act, int64_t inter, int b) {
  const T* g = gate_up + b * 2 * inter;
  for (int64_t i = threadIdx.x; i < inter; i += blockDim.x) {
    const float x = gpu_to_float(g[i]);
    store_f32(act + b * inter + i, x / (1.f + expf(-x)) * gpu_to_float(g[inter + i]));
  }
}

}  // namespace kog::gpu::decode
