// The small work items of the persistent decode kernel. Each op splits a batch row b into
// `part`s so that it spreads over the workgroups instead of running on one per row (items_of in
// persistent_kernel.cuh): kRowChunk elements (EMBED, RMS_NORM without a residual, SILU_MUL),
// kWarps heads (QK_NORM), kRopeHeads heads (ROPE), one KV head (KV_APPEND). An RMS_NORM that
// still adds a residual (fuse_residual_adds found no producer to take it) stays one item per
// row: its row is read-modified-written.
// Layouts: the schedule's buffers, [B, width] rows in the run dtype T; qkv rows hold
// [q heads | k heads | v heads], head_dim contiguous. Math in fp32, one rounding per store.
#pragma once
#include "gpu/decode/sync.cuh"
#include "gpu/decode/tuning.cuh"

namespace kog::gpu::decode {

// Elements [part * kRowChunk, (part + 1) * kRowChunk) of a row of `width`.
__device__ __forceinline__ void row_chunk(int64_t width, int part, int64_t& begin, int64_t& end) {
  begin = int64_t(part) * kRowChunk;
  end = begin + kRowChunk < width ? begin + kRowChunk : width;
}

// out[b] = embed[token[b]] (a row copy), chunk `part` of out's `width`: hidden, or a lane-wide
// buffer's n_lanes hidden (Laneformer: every lane starts from the embedding).
template <typename T>
__device__ void embed_item(const T* __restrict__ table, const int32_t* tokens, T* out, int64_t hidden, int64_t width,
                           int b, int part) {
  const T* src = table + int64_t(tokens[b]) * hidden;
  int64_t i0, i1;
  row_chunk(width, part, i0, i1);
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) out[b * width + i] = src[i % hidden];
}

// out[b] = rmsnorm(x[b]) * w over chunk `part` of the row: every item sums the squares of the
// whole row (the same order in each, so every chunk gets the same scale). out must not alias x.
template <typename T>
__device__ void rmsnorm_chunk_item(const T* x, const T* __restrict__ w, T* out, int64_t width, float eps, int b,
                                   int part, float* scratch) {
  const T* xr = x + b * width;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const float v = gpu_to_float(xr[i]);
    ss += v * v;
  }
  const float inv = 1.f / sqrtf(block_sum(ss, scratch) / float(width) + eps);
  int64_t i0, i1;
  row_chunk(width, part, i0, i1);
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
    store_f32(out + b * width + i, gpu_to_float(xr[i]) * inv * gpu_to_float(w[i]));
}

// With residual: residual[b] += x[b] (rounded to T), out[b] = rmsnorm(residual[b]) * w.
// Without: out[b] = rmsnorm(x[b]) * w. out may alias x. One item per row.
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

// Per-head RMSNorm of q heads (weight qw) and k heads (weight kw) of qkv row b, heads
// [part * kWarps, (part + 1) * kWarps): a warp per head.
template <typename T>
__device__ void qk_norm_item(T* qkv, int64_t qkv_width, const T* __restrict__ qw, const T* __restrict__ kw,
                             int n_q, int n_kv, int hd, float eps, int b, int part) {
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int h = part * kWarps + warp;
  if (h >= n_q + n_kv) return;  // whole warps; no block-wide sync in this item
  T* v = qkv + b * qkv_width + int64_t(h) * hd;
  const T* w = h < n_q ? qw : kw;
  float ss = 0.f;
  for (int d = lane; d < hd; d += KOG_WARP_SIZE) ss += gpu_to_float(v[d]) * gpu_to_float(v[d]);
  const float inv = 1.f / sqrtf(warp_reduce_sum(ss) / float(hd) + eps);
  for (int d = lane; d < hd; d += KOG_WARP_SIZE) store_f32(v + d, gpu_to_float(v[d]) * inv * gpu_to_float(w[d]));
}

// Rotates the q and k heads [part * kRopeHeads, (part + 1) * kRopeHeads) of qkv row b at
// position pos (NeoX halves or GPT-J pairs).
template <typename T>
__device__ void rope_item(T* qkv, int64_t qkv_width, const float* __restrict__ inv_freq, int64_t pos,
                          int n_heads, int hd, int rotary_dim, bool neox, int b, int part) {
  const int half = rotary_dim / 2;
  const int h0 = part * kRopeHeads, nh = n_heads - h0 < kRopeHeads ? n_heads - h0 : kRopeHeads;
  for (int t = threadIdx.x; t < nh * half; t += blockDim.x) {
    const int h = h0 + t / half, i = t % half;
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

// Copies k and v head h of qkv row b into the layer's cache at `slot`.
// kv_layer: [num_blocks, 2, n_kv, block_size, hd].
template <typename T>
__device__ void kv_append_item(const T* qkv, int64_t qkv_width, T* kv_layer, int64_t slot, int n_q, int n_kv,
                               int hd, int block_size, int b, int h) {
  const int64_t block = slot / block_size, off = slot % block_size;
  const T* k = qkv + b * qkv_width + int64_t(n_q) * hd;
  const T* v = k + int64_t(n_kv) * hd;
  for (int t = h * hd + threadIdx.x; t < (h + 1) * hd; t += blockDim.x) {
    const int d = t % hd;
    const int64_t ko = ((block * 2 + 0) * n_kv + h) * block_size * hd + off * hd + d;
    const int64_t vo = ((block * 2 + 1) * n_kv + h) * block_size * hd + off * hd + d;
    kv_layer[ko] = k[t];
    kv_layer[vo] = v[t];
  }
}

// act[b] = silu(gate[b]) * up[b] over chunk `part`; gate_up row = [gate | up], each `inter` wide.
template <typename T>
__device__ void silu_mul_item(const T* gate_up, T* act, int64_t inter, int b, int part) {
  const T* g = gate_up + b * 2 * inter;
  int64_t i0, i1;
  row_chunk(inter, part, i0, i1);
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const float x = gpu_to_float(g[i]);
    store_f32(act + b * inter + i, x / (1.f + expf(-x)) * gpu_to_float(g[inter + i]));
  }
}

}  // namespace kog::gpu::decode
