// Paged attention as two kinds of work items (FlashDecoding split over the context):
//   partial (query, g, part): the G = n_q / n_kv query heads of KV head g (the GQA group) over
//       cached tokens [part * P, min(kv_len, (part + 1) * P)) (P, the partition, is
//       kAttnPartition or, in the persistent kernel, smaller for short contexts) ->
//       per head an unnormalized accumulator, running max and exp-sum:
//       partials[query, h, part, :hd + 2] for h in [g * G, (g + 1) * G);
//   combine (query, heads): merges the partitions by log-sum-exp and stores the heads' output
//       (attn_combine_heads; the persistent kernel runs it in the last partial item of a group).
// A decode query sees its whole context; a prefill query at position p sees keys [0, p] (causal);
// with a sliding window W > 0 only keys (p - W, p] (PagedAttentionParams::window): a partition
// wholly before the window is an empty range.
// Used by the persistent decode kernel and by the standalone kog::gpu::paged_attention.
//
// Inside a partial item: a K or V row (hd * sizeof(T) bytes) is read in 16-byte vectors by a
// slot of L lanes (L = the vectors per row rounded up to a power of two, at most a warp), so a
// warp has KOG_WARP_SIZE / L tokens in flight and the workgroup kWarps times that; each K/V row
// is read once for up to kAttnHeadsPerPass heads of the group (G > kAttnHeadsPerPass: the rows
// are re-read per pass, from L1/L2). Slots keep online-softmax states per head, merged by warp
// shuffles, then across warps in shared memory. Requires hd * sizeof(T) % 16 == 0 and 16-byte
// aligned K/V rows (attn_vectorizable).
#pragma once
#include <cfloat>

#include "gpu/decode/sync.cuh"
#include "gpu/decode/tuning.cuh"

namespace kog::gpu::decode {

struct AttnShape {
  int n_q, n_kv, hd, block_size;
  float scale;
};

// Query heads whose states one pass over a partition's K/V rows keeps (registers per lane:
// 2 x kAttnHeadsPerPass x the lane's K/V elements).
constexpr int kAttnHeadsPerPass = 4;

// Shared memory the partial item needs, in floats: per warp and head of a pass (acc[hd], m, l).
constexpr int kAttnPartialSmemFloats = kWarps * kAttnHeadsPerPass * (kMaxHeadDim + 2);

__host__ __device__ __forceinline__ int attn_parts(int64_t kv_len, int64_t partition) {
  return int((kv_len + partition - 1) / partition);
}

// Whether head_dim suits the 16-byte K/V loads of attn_partial_item.
__host__ __device__ __forceinline__ bool attn_vectorizable(int64_t head_dim, int64_t elem_bytes) {
  return head_dim > 0 && head_dim <= kMaxHeadDim && (head_dim * elem_bytes) % 16 == 0;
}

// 16-byte vectors of a K/V row a lane reads at most (hd <= kMaxHeadDim).
template <typename T>
constexpr int attn_max_vecs_per_lane() {
  constexpr int row_vecs = kMaxHeadDim * int(sizeof(T)) / 16;
  return row_vecs > KOG_WARP_SIZE ? row_vecs / KOG_WARP_SIZE : 1;
}

// The GQA group of KV head kvh of one query over keys [part * P, min(kv_len, (part + 1) * P))
// (P = partition) of a sequence whose block table row is `table`, cut to the last `window` keys
// when window > 0, -> dst[h * dst_head_stride .. + hd + 2] = (acc..., max, sum) for each head h
// of the group; an empty range stores sum 0 (the combine skips it). q: the query's [n_q, hd] row.
template <typename T>
__device__ void attn_partial_item(const T* q, const T* kv_layer, const int32_t* table, int64_t kv_len, int kvh,
                                  float* dst, int64_t dst_head_stride, const AttnShape& s, int part, int partition,
                                  int64_t window, float* smem) {
  constexpr int kV = kVec16<T>;
  constexpr int kMaxVpl = attn_max_vecs_per_lane<T>();
  constexpr int kE = kMaxVpl * kV;  // K/V elements per lane at most
  using V = Vec<T, kV>;
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int hd = s.hd, group = s.n_q / s.n_kv;
  const int row_vecs = hd * int(sizeof(T)) / 16;
  int L = 1;  // lanes per token slot: a power of two >= row_vecs, at most a warp
  while (L < row_vecs && L < KOG_WARP_SIZE) L *= 2;
  const int vpl = (row_vecs + L - 1) / L;  // <= kMaxVpl
  const int slot_lane = lane % L, slots_per_warp = KOG_WARP_SIZE / L;
  const int n_slots = kWarps * slots_per_warp;
  const int64_t first = window > 0 && kv_len > window ? kv_len - window : 0;  // the query sits at kv_len - 1
  const int64_t p0 = int64_t(part) * partition;  // the partition's keys: [p0, p0 + partition)
  const int64_t t0 = p0 > first ? p0 : first;
  const int64_t t1 = kv_len < p0 + partition ? kv_len : p0 + partition;
  const int64_t head_elems = int64_t(s.block_size) * hd;  // one (block, K or V, kv head) slab

  for (int h0 = 0; h0 < group; h0 += kAttnHeadsPerPass) {
    const int nh = group - h0 < kAttnHeadsPerPass ? group - h0 : kAttnHeadsPerPass;
    // This lane's elements of the pass's query heads (scaled), and their running states.
    float qv[kAttnHeadsPerPass][kE], acc[kAttnHeadsPerPass][kE], m[kAttnHeadsPerPass], l[kAttnHeadsPerPass];
#pragma unroll
    for (int j = 0; j < kAttnHeadsPerPass; ++j) {
      m[j] = -FLT_MAX, l[j] = 0.f;
      const T* qh = q + int64_t(kvh * group + h0 + (j < nh ? j : 0)) * hd;
#pragma unroll
      for (int i = 0; i < kMaxVpl; ++i) {
        const int v = slot_lane + i * L;
        const bool live = i < vpl && v < row_vecs && j < nh;
        V qvec;
        if (live) qvec = load16(reinterpret_cast<const V*>(qh) + v);
#pragma unroll
        for (int e = 0; e < kV; ++e) {
          qv[j][i * kV + e] = live ? gpu_to_float(qvec.v[e]) * s.scale : 0.f;
          acc[j][i * kV + e] = 0.f;
        }
      }
    }
    // Warp-uniform trip count (the shuffles need every lane): slot s = warp * slots_per_warp +
    // lane / L takes tokens t0 + s, t0 + s + n_slots, ...; a slot past t1 loads nothing.
    for (int64_t base = t0 + warp * slots_per_warp; base < t1; base += n_slots) {
      const int64_t t = base + lane / L;
      const bool live_t = t < t1;
      V kvec[kMaxVpl], vvec[kMaxVpl];  // K and V in flight together
      if (live_t) {
        const int64_t block = table[t / s.block_size], off = t % s.block_size;
        const T* k = kv_layer + ((block * 2 + 0) * s.n_kv + kvh) * head_elems + off * hd;
        const T* vrow = kv_layer + ((block * 2 + 1) * s.n_kv + kvh) * head_elems + off * hd;
#pragma unroll
        for (int i = 0; i < kMaxVpl; ++i) {
          const int v = slot_lane + i * L;
          if (i < vpl && v < row_vecs) {
            kvec[i] = load16(reinterpret_cast<const V*>(k) + v);
            vvec[i] = load16(reinterpret_cast<const V*>(vrow) + v);
          }
        }
      }
      float kf[kE], vf[kE];
#pragma unroll
      for (int i = 0; i < kMaxVpl; ++i) {
        const bool live = live_t && i < vpl && slot_lane + i * L < row_vecs;
#pragma unroll
        for (int e = 0; e < kV; ++e) {
          kf[i * kV + e] = live ? gpu_to_float(kvec[i].v[e]) : 0.f;
          vf[i * kV + e] = live ? gpu_to_float(vvec[i].v[e]) : 0.f;
        }
      }
#pragma unroll
      for (int j = 0; j < kAttnHeadsPerPass; ++j) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kE; ++e) dot += qv[j][e] * kf[e];
        for (int mask = L / 2; mask > 0; mask >>= 1) dot += gpu_shfl_xor(dot, mask);  // over the slot
        if (live_t) {
          const float m_new = fmaxf(m[j], dot);
          const float corr = expf(m[j] - m_new), p = expf(dot - m_new);
          l[j] = l[j] * corr + p;
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[j][e] = acc[j][e] * corr + p * vf[e];
          m[j] = m_new;
        }
      }
    }
    // Merge the warp's slots (lanes slot_lane, slot_lane + L, ... hold the same elements).
    for (int mask = L; mask < KOG_WARP_SIZE; mask <<= 1) {
#pragma unroll
      for (int j = 0; j < kAttnHeadsPerPass; ++j) {
        const float om = gpu_shfl_xor(m[j], mask), ol = gpu_shfl_xor(l[j], mask);
        const float big = fmaxf(m[j], om);
        const float f = l[j] > 0.f ? expf(m[j] - big) : 0.f, of = ol > 0.f ? expf(om - big) : 0.f;
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[j][e] = acc[j][e] * f + gpu_shfl_xor(acc[j][e], mask) * of;
        l[j] = l[j] * f + ol * of;
        m[j] = big;
      }
    }
    // Across warps: smem[warp][j] = (acc[hd], m, l) from the warp's first slot.
    if (lane < L) {
#pragma unroll
      for (int j = 0; j < kAttnHeadsPerPass; ++j) {
        float* mine = smem + (warp * kAttnHeadsPerPass + j) * (kMaxHeadDim + 2);
#pragma unroll
        for (int i = 0; i < kMaxVpl; ++i) {
          const int v = slot_lane + i * L;
          if (i < vpl && v < row_vecs)
#pragma unroll
            for (int e = 0; e < kV; ++e) mine[v * kV + e] = acc[j][i * kV + e];
        }
        if (lane == 0) mine[kMaxHeadDim] = m[j], mine[kMaxHeadDim + 1] = l[j];
      }
    }
    __syncthreads();
    for (int x = threadIdx.x; x < nh * (hd + 2); x += blockDim.x) {
      const int j = x / (hd + 2), d = x % (hd + 2);
      float big_m = -FLT_MAX;
      for (int w = 0; w < kWarps; ++w) {
        const float* st = smem + (w * kAttnHeadsPerPass + j) * (kMaxHeadDim + 2);
        if (st[kMaxHeadDim + 1] > 0.f) big_m = fmaxf(big_m, st[kMaxHeadDim]);
      }
      float val = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float* st = smem + (w * kAttnHeadsPerPass + j) * (kMaxHeadDim + 2);
        if (st[kMaxHeadDim + 1] > 0.f) val += (d < hd ? st[d] : st[kMaxHeadDim + 1]) * expf(st[kMaxHeadDim] - big_m);
      }
      dst[int64_t(kvh * group + h0 + j) * dst_head_stride + d] = d == hd ? big_m : val;  // [acc..., max, sum]
    }
    __syncthreads();  // smem is reused by the next pass or item
  }
}

// out [n_heads, hd] = per head j the log-sum-exp merge of its partials [n_parts, hd + 2] at
// partials + j * head_stride: one thread per (head, dim), each computing its head's max and
// denominator over the parts (cached re-reads; no block-wide sync).
template <typename T>
__device__ void attn_combine_heads(const float* partials, int64_t head_stride, int n_heads, int n_parts, T* out,
                                   int hd) {
  for (int x = threadIdx.x; x < n_heads * hd; x += blockDim.x) {
    const int j = x / hd, d = x % hd;
    const float* ph = partials + j * head_stride;
    float big_m = -FLT_MAX;
    for (int p = 0; p < n_parts; ++p)
      if (ph[p * (hd + 2) + hd + 1] > 0.f) big_m = fmaxf(big_m, ph[p * (hd + 2) + hd]);
    float denom = 0.f, num = 0.f;
    for (int p = 0; p < n_parts; ++p) {
      const float* st = ph + p * (hd + 2);
      if (st[hd + 1] > 0.f) {
        const float f = expf(st[hd] - big_m);
        denom += st[hd + 1] * f;
        num += st[d] * f;
      }
    }
    store_f32(out + x, num / denom);
  }
}

}  // namespace kog::gpu::decode
