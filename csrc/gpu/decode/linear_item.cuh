// GEMV work item for decode batches (1..kMaxBatch rows of x): out[b, r] = x[b] . w[r] (+ bias[r]).
// Used by the persistent decode kernel (LINEAR ops) and by the standalone kog::gpu::linear.
//
// Item i covers output rows [i * rows_per_item, (i + 1) * rows_per_item), rows_per_item =
// kWarps * kLinearRowsPerWarp. Warp w takes kLinearRowsPerWarp consecutive rows; its lanes
// stride over the row in 16-byte vectors (coalesced), fp32 accumulators per batch row, one
// warp reduction per output. Requires k % kVec16<T> == 0 and 16-byte aligned rows of w and x.
// Every weight and x access is one 16-byte load (load16; the CI's ISA check reads the machine
// code for it), kLinearUnrollBatch1 (batch 1) or kLinearUnroll weight vectors in flight per lane.
#pragma once
#include "gpu/decode/tuning.cuh"

namespace kog::gpu::decode {

template <typename T>
using WVec = Vec<T, kVec16<T>>;

__device__ __forceinline__ int linear_rows_per_item() { return kWarps * kLinearRowsPerWarp; }

// The first kPrefetchVecs vectors this lane will read of its warp's first row in item `item`.
template <typename T>
struct WeightPrefetch {
  WVec<T> v[kPrefetchVecs];
};

template <typename T>
__device__ __forceinline__ void linear_prefetch(const T* __restrict__ w, int64_t n, int64_t k, int64_t item,
                                                WeightPrefetch<T>& pf) {
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int64_t row = item * linear_rows_per_item() + int64_t(warp) * kLinearRowsPerWarp;
  const int64_t chunks = k / kVec16<T>;
  if (row >= n) return;
  const WVec<T>* wr = reinterpret_cast<const WVec<T>*>(w + row * k);
#pragma unroll
  for (int i = 0; i < kPrefetchVecs; ++i) {
    const int64_t c = lane + int64_t(i) * KOG_WARP_SIZE;
    if (c < chunks) pf.v[i] = load16(wr + c);
  }
}

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
template <typename T, int kB, int kUnroll, typename OutT>
__device__ __forceinline__ void linear_row(const WVec<T>* __restrict__ wr, const T* __restrict__ x, int64_t x_stride,
                                           OutT* out, int64_t out_stride, int batch, int64_t chunks, int64_t row,
                                           float bv, const WeightPrefetch<T>& pf, bool use_pf, bool accumulate) {
  const int lane = threadIdx.x % KOG_WARP_SIZE;
  float acc[kB];
#pragma unroll
  for (int b = 0; b < kB; ++b) acc[b] = 0.f;
  int64_t c = lane;
  if (use_pf) {
#pragma unroll
    for (int i = 0; i < kPrefetchVecs; ++i, c += KOG_WARP_SIZE)
      if (c < chunks) fma_chunk<T, kB>(pf.v[i], x, x_stride, c, batch, acc);
  }
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
        OutT* o = out + b * out_stride + row;
        if (accumulate) {  // o += the product rounded to OutT, as the unfused add (x stored, then added)
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

// pf: what linear_prefetch loaded for this item, used when use_pf. OutT: T or float (logits).
// accumulate: out += x . w (+ bias), the product rounded to OutT first (a residual add fused
// into its producer, schedule::fuse_residual_adds).
template <typename T, typename OutT>
__device__ __forceinline__ void linear_item(const T* __restrict__ w, const T* __restrict__ bias, const T* x, int64_t x_stride,
                            OutT* out, int64_t out_stride, int batch, int64_t n, int64_t k, int64_t item,
                            const WeightPrefetch<T>& pf, bool use_pf, bool accumulate = false) {
  const int warp = threadIdx.x / KOG_WARP_SIZE;
  const int64_t chunks = k / kVec16<T>;
  for (int rr = 0; rr < kLinearRowsPerWarp; ++rr) {
    const int64_t row = item * linear_rows_per_item() + int64_t(warp) * kLinearRowsPerWarp + rr;
    if (row >= n) break;  // uniform over the warp
    const WVec<T>* wr = reinterpret_cast<const WVec<T>*>(w + row * k);
    const float bv = bias != nullptr ? gpu_to_float(bias[row]) : 0.f;
    const bool pf_row = rr == 0 && use_pf;
    if (batch == 1)  // uniform over the grid
      linear_row<T, 1, kLinearUnrollBatch1>(wr, x, x_stride, out, out_stride, batch, chunks, row, bv, pf, pf_row,
                                            accumulate);
    else
      linear_row<T, kMaxBatch, kLinearUnroll>(wr, x, x_stride, out, out_stride, batch, chunks, row, bv, pf, pf_row,
                                              accumulate);
  }
}

__device__ __forceinline__ int64_t linear_items(int64_t n) {
  return (n + linear_rows_per_item() - 1) / linear_rows_per_item();
}

}  // namespace kog::gpu::decode
