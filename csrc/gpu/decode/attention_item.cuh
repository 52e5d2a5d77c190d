// Paged attention as two kinds of work items (FlashDecoding split over the context):
//   partial (query, h, part): query head h over cached tokens
//       [part * kAttnPartition, min(kv_len, (part + 1) * kAttnPartition)) -> unnormalized
//       accumulator, running max and exp-sum: partials[query, h, part, :hd + 2];
//   combine (query, h): merges the partitions by log-sum-exp and stores the head's output.
// A decode query sees its whole context; a prefill query at position p sees keys [0, p] (causal).
// Used by the persistent decode kernel and by the standalone kog::gpu::paged_attention.
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
  float scale;
};

// Shared memory the partial item needs, in floats.
constexpr int kAttnPartialSmemFloats = (kThreads / 32) * (kMaxHeadDim + 2);

__host__ __device__ __forceinline__ int attn_parts(int64_t kv_len) {
  return int((kv_len + kAttnPartition - 1) / kAttnPartition);
}

// One query head qh [hd] over keys [part * P, min(kv_len, (part + 1) * P)) of a sequence whose
// block table row is `table`, KV head kvh -> dst [hd + 2] = (acc..., max, sum); an empty range
// stores sum 0 (the combine skips it).
template <typename T>
__device__ void attn_partial_item(const T* qh, const T* kv_layer, const int32_t* table, int64_t kv_len, int kvh,
                                  float* dst, const AttnShape& s, int part, float* smem) {
  constexpr int kPerLane = kMaxHeadDim / KOG_WARP_SIZE;
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int hd = s.hd;
  const int64_t t0 = int64_t(part) * kAttnPartition;
  const int64_t t1 = kv_len < t0 + kAttnPartition ? kv_len : t0 + kAttnPartition;

  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + j * KOG_WARP_SIZE;
    qv[j] = d < hd ? gpu_to_float(qh[d]) * s.scale : 0.f;
    acc[j] = 0.f;
  }
  float m = -FLT_MAX, l = 0.f;
  for (int64_t t = t0 + warp; t < t1; t += kWarps) {
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

// out [hd] = the log-sum-exp merge of partials [n_parts, hd + 2].
template <typename T>
__device__ void attn_combine_item(const float* partials, int n_parts, T* out, int hd) {
  float big_m = -FLT_MAX;
  for (int p = 0; p < n_parts; ++p)
    if (partials[p * (hd + 2) + hd + 1] > 0.f) big_m = fmaxf(big_m, partials[p * (hd + 2) + hd]);
  float denom = 0.f;
  for (int p = 0; p < n_parts; ++p) {
    const float* st = partials + p * (hd + 2);
    if (st[hd + 1] > 0.f) denom += st[hd + 1] * expf(st[hd] - big_m);
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float num = 0.f;
    for (int p = 0; p < n_parts; ++p) {
      const float* st = partials + p * (hd + 2);
      if (st[hd + 1] > 0.f) num += st[d] * expf(st[hd] - big_m);
    }
    store_f32(out + d, num / denom);
  }
}

}  // namespace kog::gpu::decode
