// GEMV work item for decode batches (1..kMaxBatch rows of x): out[b, r] = x[b] . w[r] (+ bias[r]).
// Used by the persistent decode kernel (LINEAR ops) and by the standalone kog::gpu::linear.
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
#include "gpu/decode/weight_stage.cuh"

namespace kog::gpu::decode {

// acc[b] += w . x[b] over one 16-byte chunk c, for the first `batch` (<= kB) rows of x.
template <typename T, int kB>
__device__ __forceinline__ void fma_chunk(WVec<T> wv, const T* __restrict__ x, int64_t x_stride,
                                          int64_t c, int batch, float (&acc)[kB]) {
  constexpr int V = kVec16<T>;
  float wf[V];
#pragma unroll
  for (int j = 0; j < V; ++j) wf[j] = gpu_to_float(wv.v[j]);
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    if (b < batch) {  // a guard, not a break: the loop stays unrolled and acc in registers
      const WVec<T> xv = load16(reinterpret_cast<const WVec<T>*>(x + b * x_stride) + c);
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < V; ++j) s += wf[j] * gpu_to_float(xv.v[j]);
      acc[b] += s;
    }
  }
}

// One output row for the first `batch` (<= kB) rows of x: kUnroll weight vectors in flight per
// lane, then their math. Instantiated per batch class, so that batch 1 (decode of one agent)
// keeps deep weight streams without the registers of 8 rows of x.
// What a GEMV item does with its products (+ bias): store them; add them into out (a residual
// add fused into its producer, schedule::fuse_residual_adds), each rounded to OutT first as the
// unfused pair did; or (kSiluMul, schedule::kOpLinearSiluMul) out[g] = silu(gate) * up, gate and
// up rounded to T first, as the unfused LINEAR stored them and SILU_MUL read them.
enum class GemvEpilogue { kStore, kAccumulate, kSiluMul };

template <typename T, int kB, int kUnroll, int kStaged, typename OutT, typename Stages>
__device__ __forceinline__ void linear_row(const WVec<T>* __restrict__ wr, const T* __restrict__ x, int64_t x_stride,
                                           OutT* out, int64_t out_stride, int batch, int64_t chunks,
                                           int64_t out_col, float bv, const Stages& st, int stage, int rr,
                                           GemvEpilogue ep, float (&gate)[kB]) {
  const int lane = threadIdx.x % KOG_WARP_SIZE;
  float acc[kB];
#pragma unroll
  for (int b = 0; b < kB; ++b) acc[b] = 0.f;
  int64_t c = lane;
#pragma unroll
  for (int v = 0; v < kStaged; ++v, c += KOG_WARP_SIZE)
    if (c < chunks) fma_chunk<T, kB>(st.get(stage, rr, v), x, x_stride, c, batch, acc);
  for (; c + (kUnroll - 1) * KOG_WARP_SIZE < chunks; c += kUnroll * KOG_WARP_SIZE) {
    WVec<T> wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) wv[u] = load16(wr + c + u * KOG_WARP_SIZE);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) fma_chunk<T, kB>(wv[u], x, x_stride, c + u * KOG_WARP_SIZE, batch, acc);
  }
  for (; c < chunks; c += KOG_WARP_SIZE) fma_chunk<T, kB>(load16(wr + c), x, x_stride, c, batch, acc);
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    if (b < batch) {
      const float s = warp_reduce_sum(acc[b]);
      if (lane == 0) {
        if (ep == GemvEpilogue::kSiluMul) {
          T t;  // the product as GATE_UP held it
          store_f32(&t, s + bv);
          if (rr == 0) {
            gate[b] = load_f32(&t);
          } else {  // the up row: out = silu(gate) * up, rounded once (SILU_MUL's math)
            const float g = gate[b];
            store_f32(out + b * out_stride + out_col, g / (1.f + expf(-g)) * load_f32(&t));
          }
        } else {
          OutT* o = out + b * out_stride + out_col;
          if (ep == GemvEpilogue::kAccumulate) {  // o += the product rounded to OutT
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

// The rows of one item for one batch class (kB rows of x at most).
template <typename T, typename OutT, int kStaged, int kB, int kUnroll, typename Stages>
__device__ __forceinline__ void linear_item_rows(const T* __restrict__ w, const T* __restrict__ bias, const T* x,
                                                 int64_t x_stride, OutT* out, int64_t out_stride, int batch, int64_t n,
                                                 int64_t k, int64_t item, const Stages& st, int stage, GemvEpilogue ep) {
  const bool glu = ep == GemvEpilogue::kSiluMul;
  const int64_t chunks = k / kVec16<T>;
  float gate[kB] = {};  // kSiluMul: the gate row's products, consumed by the up row (slot 1)
  for (int rr = 0; rr < kLinearRowsPerWarp; ++rr) {
    const int64_t row = gemv_weight_row(item, rr, n, glu);
    if (row >= n) break;  // uniform over the warp
    const WVec<T>* wr = reinterpret_cast<const WVec<T>*>(w + row * k);
    const float bv = bias != nullptr ? gpu_to_float(bias[row]) : 0.f;
    const int64_t out_col = glu ? gemv_weight_row(item, 0, n, true) : row;
    linear_row<T, kB, kUnroll, kStaged>(wr, x, x_stride, out, out_stride, batch, chunks, out_col, bv, st, stage, rr,
                                        ep, gate);
  }
}

// Item `item` of a GEMV over w [n, k] (rows gemv_weight_row): st / stage hold its first kStaged
// vectors per row and lane (landed: WeightStages::wait). OutT: T or float (logits). ep: what
// the products become (GemvEpilogue); kSiluMul writes out [batch, n / 2].
template <typename T, typename OutT, int kStaged, typename Stages>
__device__ __forceinline__ void linear_item(const T* __restrict__ w, const T* __restrict__ bias, const T* x, int64_t x_stride,
                            OutT* out, int64_t out_stride, int batch, int64_t n, int64_t k, int64_t item,
                            const Stages& st, int stage, GemvEpilogue ep = GemvEpilogue::kStore) {
  if (batch == 1)  // uniform over the grid
    linear_item_rows<T, OutT, kStaged, 1, kLinearUnrollBatch1>(w, bias, x, x_stride, out, out_stride, batch, n, k, item,
                                                               st, stage, ep);
  else
    linear_item_rows<T, OutT, kStaged, kMaxBatch, kLinearUnroll>(w, bias, x, x_stride, out, out_stride, batch, n, k,
                                                                 item, st, stage, ep);
}

// Items of a GEMV over n weight rows (glu: a fused gate/up, one output row per warp).
__device__ __forceinline__ int64_t linear_items(int64_t n, bool glu = false) {
  return glu ? (n / 2 + kWarps - 1) / kWarps : (n + linear_rows_per_item() - 1) / linear_rows_per_item();
}

}  // namespace kog::gpu::decode
