// Flash-style causal prefill attention over a paged KV cache (contract: csrc/ops/attention.h,
// launcher: prefill_attention.cu, tiles: gpu/decode/tuning.cuh). FlashAttention-2's loop order
// with fp32 FMA math: a workgroup keeps a tile of query rows in shared memory and streams the
// sequence's keys through it in tiles, with an online softmax, so every K/V tile read from the
// cache serves kRows query rows (the split kernel re-reads the context once per query token).
//
// Workgroup (tile, seq, kvh) owns the query rows r of sequence seq whose KV head is kvh, flattened
// as r = i * group + j (chunk token i, query head kvh * group + j), rows [tile * kRows, + kRows):
// the heads of a GQA group share every K/V tile. Chunk token i sits at position ctx + i, ctx =
// seq_len - q_len (the cache before this chunk: chunked prefill), and sees keys [0, ctx + i]
// (with a sliding window W > 0: keys (ctx + i - W, ctx + i]).
//
// Thread t = (ty, tx) = (t / 16, t % 16) owns rows ty + 16a, score columns tx + 16b of each key
// tile and output columns tx + 16c, so a row's 16 threads are one shuffle group; its running max
// and sum live replicated in those 16 threads.
#pragma once
#include <cfloat>

#include "gpu/decode/tuning.cuh"

namespace kog::gpu::prefill {

template <int kD>
struct Shared {
  static constexpr int kRows = Tile<kD>::kRows, kKeys = Tile<kD>::kKeys;
  // Rows padded by one float: the 16 threads of a row group read one column of 16 K rows.
  float q[kRows][kD + 1];      // [kRows, kD] the query tile times the softmax scale, 0 past head_dim
  float kv[kKeys][kD + 1];     // [kKeys, kD] the current K tile, then the current V tile; 0 past the keys
  float p[kRows][kKeys + 1];   // [kRows, kKeys] exp(score - running max) of the current key tile
};

// 16-lane reductions (masks < 16 stay inside a row group of one warp on every target).
static_assert(KOG_WARP_SIZE % kRowLanes == 0 && kThreads % kMaxWarpSize == 0, "row groups inside whole warps");
__device__ __forceinline__ float row_max(float v) {
#pragma unroll
  for (int m = kRowLanes / 2; m > 0; m >>= 1) v = fmaxf(v, gpu_shfl_xor(v, m));
  return v;
}
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int m = kRowLanes / 2; m > 0; m >>= 1) v += gpu_shfl_xor(v, m);
  return v;
}

// dst[k][d] = K (which 0) or V (which 1) of key n0 + k of KV head kvh, in f32, zero past kv_end
// and past head_dim. 16-byte loads: head_dim is a multiple of 16 and the cache 16-byte aligned.
template <typename T, int kD>
__device__ void load_kv_tile(const PagedAttentionParams& p, const int32_t* table, int kvh, int which, int n0,
                             int kv_end, float (*dst)[kD + 1]) {
  constexpr int kV = kVec16<T>, kVecsPerRow = kD / kV, kKeys = Tile<kD>::kKeys;
  const int hd = int(p.head_dim), bs = int(p.block_size);
  const T* cache = static_cast<const T*>(p.kv_cache);
  for (int e = threadIdx.x; e < kKeys * kVecsPerRow; e += kThreads) {
    const int k = e / kVecsPerRow, d = e % kVecsPerRow * kV, key = n0 + k;
    float f[kV];
    if (key < kv_end && d < hd) {
      const int64_t block = table[key / bs];
      const T* src = cache + ((block * 2 + which) * p.n_kv_heads + kvh) * bs * hd + int64_t(key % bs) * hd + d;
      const Vec<T, kV> x = *reinterpret_cast<const Vec<T, kV>*>(src);
#pragma unroll
      for (int j = 0; j < kV; ++j) f[j] = gpu_to_float(x.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kV; ++j) f[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < kV; ++j) dst[k][d + j] = f[j];
  }
}

// One workgroup of kThreads threads: query tile `tile` of sequence seq, KV head kvh.
template <typename T, int kD>
__device__ void prefill_tile(const PagedAttentionParams& p, int64_t tile, int64_t seq, int kvh, Shared<kD>& sm) {
  constexpr int kRows = Tile<kD>::kRows, kKeys = Tile<kD>::kKeys;
  constexpr int kRA = kRows / kRowGroups, kKB = kKeys / kRowLanes, kDC = kD / kRowLanes;
  static_assert(kRows % kRowGroups == 0 && kKeys % kRowLanes == 0 && kD % kRowLanes == 0, "whole row groups");
  const int64_t q0 = p.query_start_loc[seq], q_len = p.query_start_loc[seq + 1] - q0;
  const int group = int(p.n_q_heads / p.n_kv_heads), hd = int(p.head_dim);
  const int64_t n_rows = q_len * group, r0 = tile * kRows;
  if (r0 >= n_rows) return;  // a tile past this sequence's chunk (the grid fits the longest)
  const int ctx = int(p.seq_lens[seq] - q_len);
  const int64_t r_end = n_rows < r0 + kRows ? n_rows : r0 + kRows;
  const int kv_end = ctx + int((r_end - 1) / group) + 1;  // keys the tile's last token sees
  const int32_t* table = p.block_tables + seq * p.block_tables_stride;
  const int tx = threadIdx.x % kRowLanes, ty = threadIdx.x / kRowLanes;

  const T* q = static_cast<const T*>(p.q);
  for (int e = threadIdx.x; e < kRows * kD; e += kThreads) {
    const int row = e / kD, d = e % kD;
    const int64_t r = r0 + row;
    float v = 0.f;
    if (r < n_rows && d < hd)
      v = gpu_to_float(q[(q0 + r / group) * p.q_stride + (int64_t(kvh) * group + r % group) * hd + d]) * p.scale;
    sm.q[row][d] = v;
  }

  int pos[kRA];  // position of each row's token; -1 for rows past the chunk (every key masked)
  float m[kRA], l[kRA], o[kRA][kDC];
#pragma unroll
  for (int a = 0; a < kRA; ++a) {
    const int64_t r = r0 + ty + a * kRowGroups;
    pos[a] = r < n_rows ? ctx + int(r / group) : -1;
    m[a] = -FLT_MAX;  // finite: exp(m - m_new) stays 0 or 1, never NaN
    l[a] = 0.f;
#pragma unroll
    for (int c = 0; c < kDC; ++c) o[a][c] = 0.f;
  }

  // A sliding window (p.window > 0): row a sees keys (pos[a] - window, pos[a]]; tiles before the
  // first row's window hold no visible key.
  int n_begin = 0;
  if (p.window > 0) {
    const int64_t lo = ctx + r0 / group - p.window + 1;
    n_begin = lo > 0 ? int(lo / kKeys * kKeys) : 0;
  }
  for (int n0 = n_begin; n0 < kv_end; n0 += kKeys) {
    load_kv_tile<T, kD>(p, table, kvh, 0, n0, kv_end, sm.kv);
    __syncthreads();  // K tile (and, on the first pass, Q tile) visible
    float s[kRA][kKB];
#pragma unroll
    for (int a = 0; a < kRA; ++a)
#pragma unroll
      for (int b = 0; b < kKB; ++b) s[a][b] = 0.f;
    for (int d0 = 0; d0 < hd; d0 += kRowLanes) {  // head_dim is a multiple of 16
#pragma unroll
      for (int dd = 0; dd < kRowLanes; ++dd) {
        float qa[kRA], kb[kKB];
#pragma unroll
        for (int a = 0; a < kRA; ++a) qa[a] = sm.q[ty + a * kRowGroups][d0 + dd];
#pragma unroll
        for (int b = 0; b < kKB; ++b) kb[b] = sm.kv[tx + b * kRowLanes][d0 + dd];
#pragma unroll
        for (int a = 0; a < kRA; ++a)
#pragma unroll
          for (int b = 0; b < kKB; ++b) s[a][b] = fmaf(qa[a], kb[b], s[a][b]);
      }
    }
    // Online softmax: mask, new running max, rescale what was accumulated under the old one.
#pragma unroll
    for (int a = 0; a < kRA; ++a) {
      float mx = -INFINITY;
#pragma unroll
      for (int b = 0; b < kKB; ++b) {
        const int key = n0 + tx + b * kRowLanes;
        if (key > pos[a] || (p.window > 0 && key <= pos[a] - p.window))
          s[a][b] = -INFINITY;  // causal and the window; also every key >= kv_end
        mx = fmaxf(mx, s[a][b]);
      }
      const float m_new = fmaxf(m[a], row_max(mx));
      const float corr = expf(m[a] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int b = 0; b < kKB; ++b) {
        const float e = expf(s[a][b] - m_new);
        sm.p[ty + a * kRowGroups][tx + b * kRowLanes] = e;
        sum += e;
      }
      l[a] = l[a] * corr + row_sum(sum);
      m[a] = m_new;
#pragma unroll
      for (int c = 0; c < kDC; ++c) o[a][c] *= corr;
    }
    __syncthreads();  // every K read done, P visible
    load_kv_tile<T, kD>(p, table, kvh, 1, n0, kv_end, sm.kv);
    __syncthreads();  // V tile visible
    for (int k = 0; k < kKeys; ++k) {
      float pa[kRA], vc[kDC];
#pragma unroll
      for (int a = 0; a < kRA; ++a) pa[a] = sm.p[ty + a * kRowGroups][k];
#pragma unroll
      for (int c = 0; c < kDC; ++c) vc[c] = sm.kv[k][tx + c * kRowLanes];
#pragma unroll
      for (int a = 0; a < kRA; ++a)
#pragma unroll
        for (int c = 0; c < kDC; ++c) o[a][c] = fmaf(pa[a], vc[c], o[a][c]);
    }
    __syncthreads();  // V and P reads done before the next tile overwrites them
  }

  // NOTE: out may alias q: this workgroup's rows are the only readers of their q elements, and
  // it read them all into shared memory before its first key tile.
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int a = 0; a < kRA; ++a) {
    const int64_t r = r0 + ty + a * kRowGroups;
    if (r >= n_rows) continue;
    const float inv = 1.f / l[a];  // > 0: key 0 is visible to every row
    T* dst = out + (q0 + r / group) * p.out_stride + (int64_t(kvh) * group + r % group) * hd;
#pragma unroll
    for (int c = 0; c < kDC; ++c) {
      const int d = tx + c * kRowLanes;
      if (d < hd) store_f32(dst + d, o[a][c] * inv);
    }
  }
}

// Grid: (query tiles of the longest chunk) x n_seqs x n_kv_heads workgroups in one dimension, the
// (sequence, KV head) pair fastest; kThreads threads; head_dim <= kD.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, 1) prefill_attention_kernel(PagedAttentionParams p) {
  __shared__ Shared<kD> sm;
  const int64_t pairs = p.n_seqs * p.n_kv_heads, pair = blockIdx.x % pairs;
  // Tiles in reverse: the last tiles of a chunk see the most keys, so they start first.
  const int64_t tile = int64_t(gridDim.x) / pairs - 1 - blockIdx.x / pairs;
  prefill_tile<T, kD>(p, tile, pair / p.n_kv_heads, int(pair % p.n_kv_heads), sm);
}

}  // namespace kog::gpu::prefill
