// Paged-attention decode as two kinds of work items (FlashDecoding split over the context):
//   partial (b, h, part): query head h of sequence b over cached tokens
//       [part * kAttnPartition, min(seq_len, (part + 1) * kAttnPartition)) -> unnormalized
//       accumulator, running max and exp-sum, in partials[b, h, part, :hd + 2];
//   combine (b, h): merges the partitions by log-sum-exp and stores out[b, h * hd : (h+1) * hd].
// Used by the persistent decode kernel and by the standalone kog::gpu::paged_attention_decode.
// Query head h reads KV head h / (n_q / n_kv) (GQA); its K/V rows are re-read by the other heads
// of the group from L2. Within an item, warp w takes the partition's tokens w, w + kWarps, ...
// with the head dim spread over the lanes; the warps' states merge in shared memory.
#pragma once
#include <cfloat>

#include "gpu/decode/sync.cuh"
#include "gpu/decode/tuning.cuh"

namespace kog::gpu::decode {

struct AttnShape {
  int n_q, n_kv, hd, block_size;
  int max_blocks;       // columns of block_tables
  int max_parts;        // partitions per (b, h) in partials
  float scale;
  int64_t q_stride;     // elements between sequences of q
  int64_t out_stride;   // elements between sequences of out
};

// Shared memory the partial item needs, in floats.
constexpr int attn_partial_smem_floats() { return (kThreads / 32) * (kMaxHeadDim + 2); }

__device__ __forceinline__ int attn_parts(int seq_len) { return (seq_len + kAttnPartition - 1) / kAttnPartition; }

template <typename T>
__device__ void attn_partial_item(const T* q, const T* kv_layer, const int32_t* block_tables,
                                  const int32_t* seq_lens, float* partials, const AttnShape& s, int b, int h,
                                  int part, float* smem) {
  constexpr int kPerLane = kMaxHeadDim / KOG_WARP_SIZE;
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int hd = s.hd, kvh = h / (s.n_q / s.n_kv);
  const int seq_len = seq_lens[b];
  const int t0 = part * kAttnPartition;
  const int t1 = min(seq_len, t0 + kAttnPartition);
  const int32_t* table = block_tables + int64_t(b) * s.max_blocks;
  const T* qh = q + b * s.q_stride + int64_t(h) * hd;

  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + j * KOG_WARP_SIZE;
    qv[j] = d < hd ? gpu_to_float(qh[d]) * s.scale : 0.f;
    acc[j] = 0.f;
  }
  float m = -FLT_MAX, l = 0.f;
  for (int t = t0 + warp; t < t1; t += kWarps) {
    const int64_t block = table[t / s.block_size], off = t % s.block_size;
    const T* k = kv_layer + ((block * 2 + 0) * s.n_kv + kvh) * s.block_size * hd + off * hd;
    const T* v = kv_layer + ((block * 2 + 1) * s.n_kv + kvh) * s.block_size * hd + off * hd;
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int d = lane + j * KOG_WARP_SIZE;
      if (d < hd) dot += qv[j] * gpu_to_float(k[d]);
    }
    const float score = warp_reduce_sum(dot);
    const float m_new = fmaxf(m, score);
    const float corr = expf(m - m_new), p = expf(score - m_new);
    l = l * corr + p;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int d = lane + j * KOG_WARP_SIZE;
      acc[j] = acc[j] * corr + (d < hd ? p * gpu_to_float(v[d]) : 0.f);
    }
    m = m_new;
  }
  // Merge the warps: smem[w] = (acc[hd], m, l).
  float* mine = smem + warp * (kMaxHeadDim + 2);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + j * KOG_WARP_SIZE;
    if (d < hd) mine[d] = acc[j];
  }
  if (lane == 0) mine[kMaxHeadDim] = m, mine[kMaxHeadDim + 1] = l;
  __syncthreads();
  float* dst = partials + ((int64_t(b) * s.n_q + h) * s.max_parts + part) * (hd + 2);
  float big_m = -FLT_MAX;
  for (int w = 0; w < kWarps; ++w) big_m = fmaxf(big_m, smem[w * (kMaxHeadDim + 2) + kMaxHeadDim]);
  for (int d = threadIdx.x; d < hd + 2; d += blockDim.x) {
    float v = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float* st = smem + w * (kMaxHeadDim + 2);
      const float f = st[kMaxHeadDim + 1] > 0.f ? expf(st[kMaxHeadDim] - big_m) : 0.f;
      v += (d < hd ? st[d] : st[kMaxHeadDim + 1]) * f;
    }
    dst[d] = d == hd ? big_m : v;  // [acc..., max, sum]
  }
  __syncthreads();  // smem is reused by the next item
}

template <typename T>
__device__ void attn_combine_item(const float* partials, const int32_t* seq_lens, T* out, const AttnShape& s,
                                  int b, int h) {
  const int hd = s.hd, n_parts = attn_parts(seq_lens[b]);
  const float* base = partials + (int64_t(b) * s.n_q + h) * s.max_parts * (hd + 2);
  float big_m = -FLT_MAX;
  for (int p = 0; p < n_parts; ++p)
    if (base[p * (hd + 2) + hd + 1] > 0.f) big_m = fmaxf(big_m, base[p * (hd + 2) + hd]);
  float denom = 0.f;
  for (int p = 0; p < n_parts; ++p) {
    const float* st = base + p * (hd + 2);
    if (st[hd + 1] > 0.f) denom += st[hd + 1] * expf(st[hd] - big_m);
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float num = 0.f;
    for (int p = 0; p < n_parts; ++p) {
      const float* st = base + p * (hd + 2);
      if (st[hd + 1] > 0.f) num += st[d] * expf(st[hd] - big_m);
    }
    store_f32(out + b * s.out_stride + int64_t(h) * hd + d, num / denom);
  }
}

}  // namespace kog::gpu::decode
