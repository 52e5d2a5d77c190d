// GEMV work item for decode batches (1..kMaxBatch rows of x): out[b, r] = x[b] . w[r] (+ bias[r]).
// Used by the persistent decode kernel (LINEAR ops) and by the standalone kog::gpu::linear,
// kog::gpu::linear_fp8 and kog::gpu::linear_q4.
//
// Weights W: T (the run dtype), Fp8E4M3 (schedule::kWeightFp8: out[b, r] = scale[r] *
// (x[b] . e4m3(w[r])) + bias[r]) or a 4-bit format (Int4Groups, Int4Q4K: schedule::kWeightQ4Groups,
// kWeightQ4K; int4.cuh); one 16-byte weight vector is kWeightElems16<W> elements (8 bf16, 16 FP8,
// one 32-element group of 4-bit codes) and meets kWeightElems16<W> / kVec16<T> 16-byte vectors of
// x. FP8 is decoded in registers (fp8.cuh) and the row scale applied once per output; 4-bit
// codes are decoded in registers through their group's affine, loaded beside each vector.
//
// Item i covers output rows [i * rows_per_item, (i + 1) * rows_per_item), rows_per_item =
// kWarps * kLinearRowsPerWarp. Warp w takes kLinearRowsPerWarp consecutive rows; its lanes
// stride over the row in 16-byte vectors (coalesced), fp32 accumulators per batch row, one
// warp reduction per output. Requires k % kVec16<T> == 0 and 16-byte aligned rows of w and x.
// Every weight and x access is one 16-byte load (load16; the CI's ISA check reads the machine
// code for it), kLinearUnrollBatch1 (batch 1) or kLinearUnroll weight vectors in flight per lane.
// The first kStaged vectors of each of a lane's rows come from a stage (weight_stage.cuh) that
// was filled ahead of the item (the persistent kernel); the standalone GEMV stages nothing.
#pragma once
#include <type_traits>

#include "gpu/decode/fp8.cuh"
#include "gpu/decode/int4.cuh"
#include "gpu/decode/weight_stage.cuh"
#include "schedule/program.h"

namespace kog::gpu::decode {

template <typename W>
constexpr bool kFp8Weights = std::is_same<W, Fp8E4M3>::value;

// wf = elements [r * V, (r + 1) * V) of one 16-byte weight vector (FP8: times 2^(bias - 15),
// undone by fp8_row_scale; 4-bit: through g, the vector's group affine). Decoded one x vector's
// worth at a time: fewer live registers.
template <typename W, int V>
__device__ __forceinline__ void decode_weights(const WVec<W>& wv, int r, GroupAffine g, float (&wf)[V]) {
  if constexpr (kInt4Weights<W>) {
    uint32_t words[4];
    __builtin_memcpy(words, &wv, 16);
    int4_decode<V>(words, r, g, wf);
  } else if constexpr (kFp8Weights<W>) {
    static_assert(V % 4 == 0, "whole 4-byte words of FP8");
    uint32_t words[4];
    __builtin_memcpy(words, &wv, 16);
#pragma unroll
    for (int q = 0; q < V / 4; ++q) fp8x4_to_float(words[r * (V / 4) + q], wf + 4 * q);
  } else {
    static_assert(V == kVec16<W>, "a run-dtype weight vector meets one x vector");
#pragma unroll
    for (int j = 0; j < V; ++j) wf[j] = gpu_to_float(wv.v[j]);
  }
}

// A staged 16-byte vector (WeightStages<T> holds raw 16-byte slots) as a vector of W.
template <typename W, typename Raw>
__device__ __forceinline__ WVec<W> as_weights(const Raw& raw) {
  static_assert(sizeof(Raw) == 16 && sizeof(WVec<W>) == 16, "a stage slot is one 16-byte vector");
  WVec<W> out;
  __builtin_memcpy(&out, &raw, 16);
  return out;
}

// An RMSNorm folded into a GEMV's prologue (schedule::expand_gpu_program, Op::w2): the GEMV's x
// is rmsnorm(in) * norm_w, each element rounded to T as the unfused RMS_NORM stored it. Every
// warp computes the scales of the rows it needs itself (rows_rms_inv): no block-wide sync.
template <typename T>
struct GemvPrologue {
  const T* norm_w = nullptr;  // [k] the norm's weight; null: x is read as it is
  float eps = 0.f;
};

// inv[b] = 1 / sqrt(mean(x[b]^2) + eps) for the first `batch` (<= kB) rows of x [., k], on every
// lane of the calling warp (rmsnorm_chunk_item's formula; the warp's summation order).
template <typename T, int kB>
__device__ __forceinline__ void rows_rms_inv(const T* __restrict__ x, int64_t x_stride, int64_t k, int batch, float eps,
                                             float (&inv)[kB]) {
  const int lane = threadIdx.x % KOG_WARP_SIZE;
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    float ss = 0.f;
    if (b < batch) {
      const WVec<T>* xr = reinterpret_cast<const WVec<T>*>(x + b * x_stride);
      for (int64_t c = lane; c < k / kVec16<T>; c += KOG_WARP_SIZE) {
        const WVec<T> xv = load16(xr + c);
#pragma unroll
        for (int j = 0; j < kVec16<T>; ++j) ss += gpu_to_float(xv.v[j]) * gpu_to_float(xv.v[j]);
      }
    }
    inv[b] = 1.f / sqrtf(warp_reduce_sum(ss) / float(k) + eps);
  }
}

// acc[b] += w . x[b] over weight vector c (x vectors c * R .. c * R + R - 1, R =
// kWeightElems16<W> / kVec16<T>), for the first `batch` (<= kB) rows of x; with kNorm, x[b] is
// first normalized: T(x * inv[b] * norm_w), the unfused RMS_NORM's values. g: 4-bit weights'
// group affine (ignored otherwise).
template <typename T, typename W, int kB, bool kNorm>
__device__ __forceinline__ void fma_chunk(WVec<W> wv, GroupAffine g, const T* __restrict__ x,
                                          int64_t x_stride, int64_t c, int batch, float (&acc)[kB],
                                          const T* __restrict__ norm_w, const float (&inv)[kB]) {
  constexpr int V = kVec16<T>, R = kWeightElems16<W> / kVec16<T>;
  static_assert(R >= 1 && kWeightElems16<W> % kVec16<T> == 0, "a weight vector covers whole x vectors");
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t xc = c * R + r;
    float wf[V], nf[V];
    decode_weights<W, V>(wv, r, g, wf);
    if constexpr (kNorm) {
      const WVec<T> nv = load16(reinterpret_cast<const WVec<T>*>(norm_w) + xc);
#pragma unroll
      for (int j = 0; j < V; ++j) nf[j] = gpu_to_float(nv.v[j]);
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      if (b < batch) {  // a guard, not a break: the loop stays unrolled and acc in registers
        const WVec<T> xv = load16(reinterpret_cast<const WVec<T>*>(x + b * x_stride) + xc);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          float xf = gpu_to_float(xv.v[j]);
          if constexpr (kNorm) {
            T t;
            store_f32(&t, xf * inv[b] * nf[j]);
            xf = load_f32(&t);
          }
          s += wf[j] * xf;
        }
        acc[b] += s;
      }
    }
  }
}

// A lane LINEAR's input slices (Laneformer, Op::lanes > 1): row r reads x columns
// [l k, (l + 1) k) of the buffer, l = lane_of(r) (schedule::LaneRows), k the weight row's length
// (width(in) / lanes); every other GEMV reads x from column 0 (linear_item without kLanes).
using GemvLanes = schedule::LaneRows;

// What a GEMV item does with its products (+ bias): store them; add them into out (a residual
// add fused into its producer, schedule::fuse_residual_adds), each rounded to OutT first as the
// unfused pair did; (kSiluMul, schedule::kOpLinearSiluMul) out[g] = silu(gate) * up; or
// (kRopeKv, schedule::kOpLinearRopeKv) rotate each q/k pair at the row's position and write
// q, k and v to out (QKV) and k, v to the layer's cache at the row's slot. The fused forms round
// the products to T first, as the unfused LINEAR stored them and SILU_MUL / ROPE / KV_APPEND
// read them, then do those ops' math: the unfused program's values exactly.
enum class GemvEpilogue { kStore, kAccumulate, kSiluMul, kRopeKv };

template <typename T>
struct GemvEpilogueArgs {
  GemvEpilogue kind = GemvEpilogue::kStore;
  // kRopeKv only
  int32_t n_q = 0, n_kv = 0, hd = 0;   // heads of the qkv row, head_dim
  bool neox = true;                    // rotate_half pairs (else GPT-J pairs)
  const float* inv_freq = nullptr;     // [hd / 2]
  const int64_t* positions = nullptr;  // [B] position of each row's token
  const int64_t* slots = nullptr;      // [B] its cache slot
  T* kv_layer = nullptr;               // [num_blocks, 2, n_kv, block_size, hd] the layer's cache
  int32_t block_size = 0;

  __device__ GemvRows rows() const {
    GemvRows r;
    r.kind = kind == GemvEpilogue::kSiluMul ? GemvRows::kGlu : kind == GemvEpilogue::kRopeKv ? GemvRows::kRopePairs
                                                                                             : GemvRows::kRows;
    r.hd = hd, r.neox = neox;
    return r;
  }
};

// kRopeKv for batch row b, lane 0: the pair (a at column c0, v at column c1) of one head.
template <typename T>
__device__ __forceinline__ void rope_kv_pair(const GemvEpilogueArgs<T>& ep, T* out, int64_t c0, int64_t c1, float a,
                                             float v, int b) {
  const int h = int(c0 / ep.hd), d0 = int(c0 % ep.hd), d1 = int(c1 % ep.hd);
  if (h < ep.n_q + ep.n_kv) {  // q or k: ROPE's math (rope_item)
    const int j = ep.neox ? d0 : d0 / 2;
    float sn, cs;
    sincosf(float(ep.positions[b]) * ep.inv_freq[j], &sn, &cs);
    const float ra = a * cs - v * sn, rv = v * cs + a * sn;
    a = ra, v = rv;
  }
  T ta, tv;
  store_f32(&ta, a);
  store_f32(&tv, v);
  out[c0] = ta, out[c1] = tv;
  if (h >= ep.n_q) {  // k or v: KV_APPEND's copy
    const bool is_v = h >= ep.n_q + ep.n_kv;
    const int g = h - ep.n_q - (is_v ? ep.n_kv : 0);
    const int64_t slot = ep.slots[b], block = slot / ep.block_size, off = slot % ep.block_size;
    T* dst = ep.kv_layer + ((block * 2 + (is_v ? 1 : 0)) * ep.n_kv + g) * ep.block_size * ep.hd + off * ep.hd;
    dst[d0] = ta, dst[d1] = tv;
  }
}

// One output row for the first `batch` (<= kB) rows of x: kUnroll weight vectors in flight per
// lane, then their math. Instantiated per batch class, so that batch 1 (decode of one agent)
// keeps deep weight streams without the registers of 8 rows of x. first: the slot-0 row's
// products (rounded to T) for the fused epilogues, which finish at slot 1; first_col its column.
// kFusable = false (the standalone GEMV): plain rows and kStore only, decided at compile time, so
// that its machine code holds nothing of the fused forms (the CI's ISA check counts its loads).
// rs: FP8 weights only, the row's fp8_row_scale. groups: 4-bit weights only, the row's part of
// Op::w_scale (group_affine).
template <typename T, typename W, int kB, int kUnroll, int kStaged, bool kFusable, bool kNorm, typename OutT,
          typename Stages>
__device__ __forceinline__ void linear_row(const WVec<W>* __restrict__ wr, const T* __restrict__ x, int64_t x_stride,
                                           OutT* out, int64_t out_stride, int batch, int64_t chunks,
                                           int64_t out_col, float rs, const void* __restrict__ groups, float bv,
                                           const Stages& st, int stage, int rr,
                                           const GemvEpilogueArgs<T>& ep, float (&first)[kB], int64_t first_col,
                                           const T* __restrict__ norm_w, const float (&inv)[kB]) {
  const int lane = threadIdx.x % KOG_WARP_SIZE;
  const GemvEpilogue kind = kFusable ? ep.kind : GemvEpilogue::kStore;
  float acc[kB];
#pragma unroll
  for (int b = 0; b < kB; ++b) acc[b] = 0.f;
  int64_t c = lane;
#pragma unroll
  for (int v = 0; v < kStaged; ++v, c += KOG_WARP_SIZE)
    if (c < chunks)
      fma_chunk<T, W, kB, kNorm>(as_weights<W>(st.get(stage, rr, v)), group_affine<W>(groups, c), x, x_stride, c,
                                 batch, acc, norm_w, inv);
  for (; c + (kUnroll - 1) * KOG_WARP_SIZE < chunks; c += kUnroll * KOG_WARP_SIZE) {
    WVec<W> wv[kUnroll];
    GroupAffine ga[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) wv[u] = load16(wr + c + u * KOG_WARP_SIZE);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) ga[u] = group_affine<W>(groups, c + u * KOG_WARP_SIZE);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      fma_chunk<T, W, kB, kNorm>(wv[u], ga[u], x, x_stride, c + u * KOG_WARP_SIZE, batch, acc, norm_w, inv);
  }
  for (; c < chunks; c += KOG_WARP_SIZE)
    fma_chunk<T, W, kB, kNorm>(load16(wr + c), group_affine<W>(groups, c), x, x_stride, c, batch, acc, norm_w, inv);
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    if (b < batch) {
      float s = warp_reduce_sum(acc[b]);
      if constexpr (kFp8Weights<W>) s *= rs;  // once per output
      if (lane == 0) {
        if (kind == GemvEpilogue::kSiluMul || kind == GemvEpilogue::kRopeKv) {
          T t;  // the product as the unfused LINEAR stored it
          store_f32(&t, s + bv);
          if (rr == 0) {
            first[b] = load_f32(&t);
          } else if (kind == GemvEpilogue::kSiluMul) {  // out = silu(gate) * up (SILU_MUL's math)
            const float g = first[b];
            store_f32(out + b * out_stride + out_col, g / (1.f + expf(-g)) * load_f32(&t));
          } else {
            rope_kv_pair(ep, reinterpret_cast<T*>(out) + b * out_stride, first_col, out_col, first[b], load_f32(&t), b);
          }
        } else {
          OutT* o = out + b * out_stride + out_col;
          if (kind == GemvEpilogue::kAccumulate) {  // o += the product rounded to OutT
            OutT t;
            store_f32(&t, s + bv);
            store_f32(o, load_f32(&t) + load_f32(o));
          } else {
            store_f32(o, s + bv);
          }
        }
      }
    }
  }
}

// The rows of one item for one batch class (kB rows of x at most); kNorm: x through pro's norm.
// kLanes: a lane LINEAR (lanes: its slices); a separate instantiation, so that every other GEMV's
// code holds nothing of it.
template <typename T, typename W, typename OutT, int kStaged, int kB, int kUnroll, bool kFusable, bool kNorm,
          bool kLanes = false, typename Stages>
__device__ __forceinline__ void linear_item_rows(const W* __restrict__ w, const void* __restrict__ w_scale,
                                                 const T* __restrict__ bias, const T* x,
                                                 int64_t x_stride, OutT* out, int64_t out_stride, int batch, int64_t n,
                                                 int64_t k, int64_t item, const Stages& st, int stage,
                                                 const GemvEpilogueArgs<T>& ep, const GemvPrologue<T>& pro,
                                                 const GemvLanes& lanes = {}) {
  const GemvRows rows = kFusable ? ep.rows() : GemvRows{};
  const int64_t chunks = k / kWeightElems16<W>;
  const int64_t first_col = gemv_weight_row(item, 0, n, rows);
  float first[kB] = {};  // fused epilogues: slot 0's products, consumed at slot 1
  float inv[kB] = {};    // kNorm: each row's RMS scale
  if constexpr (kNorm) {
    if (first_col < n) rows_rms_inv<T, kB>(x, x_stride, k, batch, pro.eps, inv);  // uniform over the warp
  }
  for (int rr = 0; rr < kLinearRowsPerWarp; ++rr) {
    const int64_t row = gemv_weight_row(item, rr, n, rows);
    if (row >= n) break;  // uniform over the warp
    const WVec<W>* wr = reinterpret_cast<const WVec<W>*>(reinterpret_cast<const char*>(w) + row * chunks * 16);
    float rs = 1.f;
    if constexpr (kFp8Weights<W>) rs = fp8_row_scale(static_cast<const float*>(w_scale)[row]);
    const void* groups = nullptr;  // the row's group affines
    if constexpr (std::is_same<W, Int4Groups>::value) groups = static_cast<const uint32_t*>(w_scale) + row * chunks;
    if constexpr (std::is_same<W, Int4Q4K>::value) groups = static_cast<const char*>(w_scale) + row * (k / 256) * 16;
    const float bv = bias != nullptr ? gpu_to_float(bias[row]) : 0.f;
    const int64_t out_col = rows.kind == GemvRows::kGlu ? first_col : row;
    // A lane row reads its lane's slice of x (a fused pair's two rows are in one lane). The
    // prologue's norm never meets lanes: expand_gpu_program folds no norm into a lane LINEAR.
    const T* xr = x;
    if constexpr (kLanes) xr += lanes.lane_of(row) * k;
    linear_row<T, W, kB, kUnroll, kStaged, kFusable, kNorm>(wr, xr, x_stride, out, out_stride, batch, chunks, out_col,
                                                            rs, groups, bv, st, stage, rr, ep, first, first_col,
                                                            pro.norm_w, inv);
  }
}

// Item `item` of a GEMV over w [n, k] (rows gemv_weight_row): st / stage hold its first kStaged
// vectors per row and lane (landed: WeightStages::wait). W: T, Fp8E4M3 with w_scale [n] f32, or a
// 4-bit tag with w_scale its group affines (int4.cuh; else null). OutT: T or float (logits). ep:
// what the products become (GemvEpilogueArgs); kSiluMul writes out [batch, n / 2]. pro: an RMSNorm applied to x first (kFusable only).
// Weight vectors in flight per lane for batches of 2-8: kLinearUnroll vectors' worth of x
// elements, so that FP8 (16 elements a vector, two or four x vectors each) holds no more rows of
// x in registers than the run-dtype GEMV (2 would spill in the persistent kernel on sm_90a).
template <typename T, typename W>
constexpr int kLinearUnrollOf =
    kLinearUnroll * kVec16<T> / kWeightElems16<W> > 1 ? kLinearUnroll * kVec16<T> / kWeightElems16<W> : 1;

// Weight vectors in flight per lane at batch 1: kLinearUnrollBatch1, and half that for 4-bit
// weights, whose vectors carry 32 elements (four times a bf16 vector's decode and FMA work to
// cover the latency) and a group affine each (a Q4_K header: 4 more registers per vector).
template <typename W>
constexpr int kLinearUnrollBatch1Of = kInt4Weights<W> ? kLinearUnrollBatch1 / 2 : kLinearUnrollBatch1;

template <typename T, typename OutT, int kStaged, bool kFusable = true, bool kLanes = false, typename W,
          typename Stages>
__device__ __forceinline__ void linear_item(const W* __restrict__ w, const void* __restrict__ w_scale,
                            const T* __restrict__ bias, const T* x, int64_t x_stride,
                            OutT* out, int64_t out_stride, int batch, int64_t n, int64_t k, int64_t item,
                            const Stages& st, int stage, const GemvEpilogueArgs<T>& ep,
                            const GemvPrologue<T>& pro = {}, const GemvLanes& lanes = {}) {
  // batch and the norm are uniform over the grid
  if constexpr (kLanes) {  // no prologue norm (expand_gpu_program folds none into a lane LINEAR)
    if (batch == 1)
      linear_item_rows<T, W, OutT, kStaged, 1, kLinearUnrollBatch1Of<W>, kFusable, false, true>(
          w, w_scale, bias, x, x_stride, out, out_stride, batch, n, k, item, st, stage, ep, pro, lanes);
    else
      linear_item_rows<T, W, OutT, kStaged, kMaxBatch, kLinearUnrollOf<T, W>, kFusable, false, true>(
          w, w_scale, bias, x, x_stride, out, out_stride, batch, n, k, item, st, stage, ep, pro, lanes);
    return;
  }
  if (kFusable && pro.norm_w != nullptr) {
    if (batch == 1)
      linear_item_rows<T, W, OutT, kStaged, 1, kLinearUnrollBatch1Of<W>, kFusable, kFusable>(
          w, w_scale, bias, x, x_stride, out, out_stride, batch, n, k, item, st, stage, ep, pro);
    else
      linear_item_rows<T, W, OutT, kStaged, kMaxBatch, kLinearUnrollOf<T, W>, kFusable, kFusable>(
          w, w_scale, bias, x, x_stride, out, out_stride, batch, n, k, item, st, stage, ep, pro);
  } else if (batch == 1) {
    linear_item_rows<T, W, OutT, kStaged, 1, kLinearUnrollBatch1Of<W>, kFusable, false>(
        w, w_scale, bias, x, x_stride, out, out_stride, batch, n, k, item, st, stage, ep, pro);
  } else {
    linear_item_rows<T, W, OutT, kStaged, kMaxBatch, kLinearUnrollOf<T, W>, kFusable, false>(
        w, w_scale, bias, x, x_stride, out, out_stride, batch, n, k, item, st, stage, ep, pro);
  }
}

// Items of a GEMV over n weight rows; paired: two rows per warp that belong together (a gate row
// and its up row, a RoPE pair), one pair per warp.
__device__ __forceinline__ int64_t linear_items(int64_t n, bool paired = false) {
  return paired ? (n / 2 + kWarps - 1) / kWarps : (n + linear_rows_per_item() - 1) / linear_rows_per_item();
}

}  // namespace kog::gpu::decode
