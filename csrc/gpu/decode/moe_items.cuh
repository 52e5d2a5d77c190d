// Mixture-of-experts work of the persistent decode kernel (schedule/gpu_program.h: kOpRouterGemv,
// kOpMoeGateUp, kOpMoeDown, kOpMoeCombine; schedule/moe_route.h: pairs, groups, their order).
//
// The router GEMV runs as a LINEAR into MoeScratch::logits; its last item to finish runs
// moe_route_tail (every batch row: softmax, top-k, renormalize, shared slots; then the pairs'
// sorted order and groups, and the gather of each pair's x row). An expert GEMV item is (group g,
// part of the expert's rows): it reads the weights of the one expert g chose, once for every row
// that chose it, over the group's gathered rows; its first weight vectors are staged as a
// LINEAR item's, by a workgroup that has acquired the layer's route (persistent_kernel.cuh:
// route_layer), never ahead of it. The combine adds each row's pairs in ascending
// expert order in f32, as the CPU executor (engine/decode_moe.cpp) does.
//
// NOTE: ties between equal router probabilities go to the lower expert id here; the CPU
// executor breaks them as torch.topk does (not always the lower id). Only exactly equal
// probabilities can pick differently.
#pragma once
#include <cfloat>
#include <climits>

#include "gpu/decode/linear_item.cuh"
#include "gpu/decode/params.h"
#include "gpu/decode/small_items.cuh"
#include "schedule/moe_route.h"

namespace kog::gpu::decode {

using schedule::kMaxMoeSlots;
using schedule::kMaxRouterRows;

constexpr int kRouterPerThread = int((kMaxRouterRows + kThreads - 1) / kThreads);
// Shared floats the route tail uses: the block reductions' scratch, then the pairs' experts and
// first flags (int32, kMaxBatch * kMaxMoeSlots each).
constexpr int kMoeReduceFloats = 2 * (kWarps + 1);
constexpr int kMoeTailSmemFloats = kMoeReduceFloats + 2 * kMaxBatch * int(kMaxMoeSlots);

// Groups an expert GEMV op has items for at this batch (moe_route.h); items past n_groups run nothing.
__device__ __forceinline__ int64_t moe_groups(const PersistentDecodeParams& p) {
  return schedule::moe_groups_max(p.dims, p.batch);
}

// Items per group of the two expert GEMVs: one gate/up pair of rows per warp, or rows of down.
__device__ __forceinline__ int64_t moe_gate_up_items_per_group(const PersistentDecodeParams& p) {
  return linear_items(2 * p.dims.expert_intermediate, true);
}
__device__ __forceinline__ int64_t moe_down_items_per_group(const PersistentDecodeParams& p) {
  return linear_items(p.dims.hidden);
}

// ROUTE row b (W ids, then W f32 weights) from the router logits [B, router_rows] in T, as
// DecodeExecutor::route computes it: f32 softmax over the routed experts, the top_k best
// (highest first), their weights renormalized to sum 1 with norm_topk, then the shared slots
// with sigmoid(logit of the extra router row). Every thread of the workgroup calls it.
template <typename T>
__device__ void moe_route_row(const PersistentDecodeParams& p, const T* logits, int32_t* route, int b,
                              float* fscratch, int* iscratch) {
  const int E = int(p.dims.n_experts), K = int(p.dims.top_k), W = int(schedule::moe_slots(p.dims));
  const int n_r = int(schedule::router_rows(p.dims));
  const T* lr = logits + int64_t(b) * n_r;
  float prob[kRouterPerThread];
  float mx = -INFINITY;
#pragma unroll
  for (int u = 0; u < kRouterPerThread; ++u) {
    const int e = int(threadIdx.x) + u * kThreads;
    prob[u] = e < E ? load_f32(lr + e) : -INFINITY;
    mx = fmaxf(mx, prob[u]);
  }
  mx = block_max(mx, fscratch);
  float sum = 0.f;
#pragma unroll
  for (int u = 0; u < kRouterPerThread; ++u) {
    const int e = int(threadIdx.x) + u * kThreads;
    prob[u] = e < E ? expf(prob[u] - mx) : 0.f;
    sum += prob[u];
  }
  const float inv = 1.f / block_sum(sum, fscratch);
#pragma unroll
  for (int u = 0; u < kRouterPerThread; ++u) prob[u] *= inv;
  int32_t* row = route + int64_t(b) * 2 * W;
  float* weights = reinterpret_cast<float*>(row + W);
  float top_sum = 0.f;
  for (int j = 0; j < K; ++j) {  // the best expert not taken yet (taken ones hold -1)
    float v = -1.f;
    int idx = INT_MAX;
#pragma unroll
    for (int u = 0; u < kRouterPerThread; ++u) {
      const int e = int(threadIdx.x) + u * kThreads;
      if (e < E && prob[u] > v) v = prob[u], idx = e;  // ascending e: a tie keeps the lower id
    }
    block_argmax(v, idx, fscratch, iscratch);
#pragma unroll
    for (int u = 0; u < kRouterPerThread; ++u)
      if (int(threadIdx.x) + u * kThreads == idx) prob[u] = -1.f;
    top_sum += v;
    if (threadIdx.x == 0) row[j] = idx, weights[j] = v;
  }
  if (threadIdx.x == 0) {
    if (p.dims.norm_topk)
      for (int j = 0; j < K; ++j) weights[j] = weights[j] / top_sum;
    if (W > K) {
      const float g = 1.f / (1.f + expf(-load_f32(lr + E)));
      for (int j = K; j < W; ++j) row[j] = E + j - K, weights[j] = g;
    }
  }
}

// The router's tail: ROUTE for every row, then the pairs' sorted order and groups
// (moe_route.h) and x rows of the router's input in that order. Run by the last router item
// to finish (it has acquired every item's logits); every thread calls it.
template <typename T>
__device__ void moe_route_tail(const PersistentDecodeParams& p, const Op& op, float* smem) {
  const MoeScratch& m = p.moe;
  const int W = int(schedule::moe_slots(p.dims)), P = p.batch * W;
  int32_t* route = reinterpret_cast<int32_t*>(p.buffers[op.out]);
  float* fscratch = smem;
  int* iscratch = reinterpret_cast<int*>(smem + kMoeReduceFloats / 2);
  for (int b = 0; b < p.batch; ++b) moe_route_row<T>(p, static_cast<const T*>(m.logits), route, b, fscratch, iscratch);
  __syncthreads();  // thread 0's ROUTE stores, for every thread of the workgroup
  int32_t* expert = reinterpret_cast<int32_t*>(smem + kMoeReduceFloats);  // [P]
  int32_t* first = expert + kMaxBatch * kMaxMoeSlots;                      // [P]
  for (int i = int(threadIdx.x); i < P; i += int(blockDim.x)) expert[i] = route[(i / W) * 2 * W + i % W];
  __syncthreads();
  for (int i = int(threadIdx.x); i < P; i += int(blockDim.x)) first[i] = schedule::moe_is_first(expert, i);
  __syncthreads();
  // expert parallelism: a pair of another rank's expert keeps its group (the groups' order is
  // the one-device order) but runs nothing, and its row skips it in the combine
  const int32_t* local = m.expert_local;
  for (int i = int(threadIdx.x); i < P; i += int(blockDim.x)) {
    const int q = schedule::moe_pair_rank(expert, P, i), row = i / W;
    const int32_t here = local != nullptr ? local[expert[i]] : expert[i];  // index in this rank's stacks
    m.pair_row[q] = row;
    m.pair_weight[q] = reinterpret_cast<const float*>(route + int64_t(row) * 2 * W + W)[i % W];
    m.row_pairs[row * W + schedule::moe_row_rank(expert, W, i)] = here >= 0 ? q : -1;
    if (first[i]) {
      const int g = schedule::moe_group_of(expert, first, P, i);
      m.group_expert[g] = here, m.group_start[g] = q;
    }
  }
  if (threadIdx.x == 0) {
    int n = 0;
    for (int i = 0; i < P; ++i) n += first[i];
    *m.n_groups = n;
    m.group_start[n] = P;
  }
  __syncthreads();  // pair_row, for the gather
  const int64_t H = p.dims.hidden, vecs = H / kVec16<T>;
  const WVec<T>* in = reinterpret_cast<const WVec<T>*>(p.buffers[op.in]);
  WVec<T>* x = static_cast<WVec<T>*>(m.x);
  for (int64_t v = threadIdx.x; v < int64_t(P) * vecs; v += blockDim.x) {
    const int64_t q = v / vecs, c = v % vecs;
    x[q * vecs + c] = load16(in + int64_t(m.pair_row[q]) * vecs + c);
  }
}

// Where expert GEMV item `item`'s weights are (kOpMoeGateUp: [gate; up] rows, a pair per warp;
// kOpMoeDown: rows of down): the matrix of the expert its group chose, the item's part within
// the group. False when the group is past the step's groups (the item runs nothing).
// NOTE: reads the layer's route scratch: only a workgroup that has acquired the route (waited
// for an op of the layer after the router) may call it.
template <typename T>
__device__ __forceinline__ bool moe_stage_source(const PersistentDecodeParams& p, const Op& op, int64_t item,
                                        StageSource& src) {
  const MoeScratch& m = p.moe;
  const bool gate_up = op.op == schedule::kOpMoeGateUp;
  const int64_t per = gate_up ? moe_gate_up_items_per_group(p) : moe_down_items_per_group(p);
  const int g = int(item / per);
  if (g >= gpu_uniform(*m.n_groups)) return false;  // fewer experts chosen than the most
  const int64_t H = p.dims.hidden, I = p.dims.expert_intermediate;
  const int64_t n = gate_up ? 2 * I : H, k = gate_up ? H : I;
  const int32_t e = gpu_uniform(m.group_expert[g]);  // the same in every lane
  if (e < 0) return false;                            // another rank's expert
  src.w = static_cast<const T*>(gate_up ? op.w0 : op.w1) + int64_t(e) * n * k;
  src.n = n, src.row_bytes = k * int64_t(sizeof(T)), src.item = item % per;
  src.rows = GemvRows{};
  src.rows.kind = gate_up ? GemvRows::kGlu : GemvRows::kRows;
  return true;
}

// One expert GEMV item (kOpMoeGateUp: gate/up rows with SiLU-mul into act; kOpMoeDown: down rows
// into y) over group g's pairs: their gathered rows, the group's expert's matrix (the weights
// moe_stage_source names). kStaged: its first vectors are in stage `stage` of st (landed).
// NOTE: it recomputes the group, expert and matrix moe_stage_source computes rather than taking
// or building a StageSource: either way LLVM (gfx940) copied the whole PersistentDecodeParams to
// scratch memory (648-656 bytes a lane; tried 2026-12-07).
template <typename T, int kStaged, typename Stages>
__device__ __forceinline__ void moe_expert_item(const PersistentDecodeParams& p, const Op& op, int64_t item,
                                                const Stages& st, int stage) {
  const MoeScratch& m = p.moe;
  const bool gate_up = op.op == schedule::kOpMoeGateUp;
  const int64_t per = gate_up ? moe_gate_up_items_per_group(p) : moe_down_items_per_group(p);
  const int g = int(item / per);
  if (g >= gpu_uniform(*m.n_groups)) return;  // fewer experts chosen than the most
  const int64_t H = p.dims.hidden, I = p.dims.expert_intermediate;
  // the same in every lane (loaded from memory this launch wrote: vector loads)
  const int32_t e = gpu_uniform(m.group_expert[g]), q0 = gpu_uniform(m.group_start[g]);
  if (e < 0) return;  // another rank's expert (its pairs are that rank's)
  const int32_t rows = gpu_uniform(m.group_start[g + 1]) - q0;
  const int64_t n = gate_up ? 2 * I : H, k = gate_up ? H : I;
  const T* w = static_cast<const T*>(gate_up ? op.w0 : op.w1) + int64_t(e) * n * k;
  T *const xs = static_cast<T*>(m.x), *const act = static_cast<T*>(m.act), *const ys = static_cast<T*>(m.y);
  const T* x = (gate_up ? xs : act) + q0 * k;  // loaded, then selected (persistent_kernel.cuh: gemv_rows)
  T* out = (gate_up ? act : ys) + q0 * (gate_up ? I : H);
  GemvEpilogueArgs<T> ep;
  ep.kind = gate_up ? GemvEpilogue::kSiluMul : GemvEpilogue::kStore;
  if (rows == 1)
    linear_item_rows<T, T, T, kStaged, 1, kLinearUnrollBatch1, true, false>(
        w, nullptr, nullptr, x, k, out, gate_up ? I : H, rows, n, k, item % per, st, stage, ep, {});
  else
    linear_item_rows<T, T, T, kStaged, kMaxBatch, kLinearUnroll, true, false>(
        w, nullptr, nullptr, x, k, out, gate_up ? I : H, rows, n, k, item % per, st, stage, ep, {});
}

// out[b] over chunk `part` of hidden = sum over row b's pairs in ascending expert order of
// weight * y, in f32, rounded once (MOE_EXPERTS' output).
template <typename T>
__device__ void moe_combine_item(const PersistentDecodeParams& p, T* out, int b, int part) {
  const MoeScratch& m = p.moe;
  const int W = int(schedule::moe_slots(p.dims));
  const int64_t H = p.dims.hidden;
  const T* y = static_cast<const T*>(m.y);
  int64_t i0, i1;
  row_chunk(H, part, i0, i1);
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    float acc = 0.f;
    for (int c = 0; c < W; ++c) {
      const int q = m.row_pairs[b * W + c];
      if (q >= 0) acc += m.pair_weight[q] * load_f32(y + int64_t(q) * H + i);  // -1: another rank's
    }
    store_f32(out + int64_t(b) * H + i, acc);
  }
}

}  // namespace kog::gpu::decode
