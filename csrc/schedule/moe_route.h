// How the GPU persistent kernel lays out one mixture-of-experts layer's work (gpu_program.h:
// kOpRouterGemv, kOpMoeGateUp, kOpMoeDown, kOpMoeCombine). Plain host+device C++: the kernel's
// router tail calls these per pair (one thread each), tests call them on the CPU
// (kog._C.moe_group_pairs).
//
// A pair is one (row, slot) of ROUTE: pair i = row * W + slot, W = top_k + shared_slots, with
// expert e_i (routed ids first, then the shared slots' experts n_experts ..). A row never holds
// one expert twice. Pairs are processed in sorted order -- by expert, rows ascending within an
// expert -- the order of the CPU executor's counting sort (engine/decode_moe.cpp): position q of
// that order holds pair sorted[q]. The pairs of one expert form a group (its rows' x rows are
// contiguous, so one GEMV reads the expert's weights once for all of them); group g is the g-th
// smallest expert chosen by any row.
#pragma once
#include <cstdint>

#include "common/host_device.h"
#include "schedule/program.h"

namespace kog::schedule {

// Slots per row (routed + shared) and router rows (n_experts + 1 with shared slots) the kernel
// takes: its router tail keeps kMaxRouterRows / 256 probabilities per thread and the pairs'
// experts in shared memory.
constexpr int64_t kMaxMoeSlots = 16;
constexpr int64_t kMaxRouterRows = 512;

// Rows of the router weight: the routed experts, plus the shared experts' gate row.
KOG_HOST_DEVICE inline int64_t router_rows(const ModelDims& d) { return d.n_experts + (d.shared_slots > 0 ? 1 : 0); }

// Slots of one row of ROUTE.
KOG_HOST_DEVICE inline int64_t moe_slots(const ModelDims& d) { return d.top_k + d.shared_slots; }

// Groups a batch can have at most: one per pair, or one per expert.
KOG_HOST_DEVICE inline int64_t moe_groups_max(const ModelDims& d, int64_t batch) {
  const int64_t pairs = batch * moe_slots(d), experts = d.n_experts + d.shared_slots;
  return pairs < experts ? pairs : experts;
}

// Whether pair i is the first pair (lowest index) of its expert.
KOG_HOST_DEVICE inline bool moe_is_first(const int32_t* expert, int32_t i) {
  for (int32_t j = 0; j < i; ++j)
    if (expert[j] == expert[i]) return false;
  return true;
}

// Position of pair i in the sorted order (by expert, then pair index).
KOG_HOST_DEVICE inline int32_t moe_pair_rank(const int32_t* expert, int32_t n_pairs, int32_t i) {
  const int32_t e = expert[i];
  int32_t r = 0;
  for (int32_t j = 0; j < n_pairs; ++j) r += expert[j] < e || (expert[j] == e && j < i);
  return r;
}

// Group of pair i: how many distinct experts below e_i the pairs chose (first[j]: moe_is_first).
KOG_HOST_DEVICE inline int32_t moe_group_of(const int32_t* expert, const int32_t* first, int32_t n_pairs, int32_t i) {
  int32_t g = 0;
  for (int32_t j = 0; j < n_pairs; ++j) g += first[j] != 0 && expert[j] < expert[i];
  return g;
}

// Rank of pair i among its own row's W pairs by expert: where the combine adds it (ascending
// expert order, as the CPU executor adds a row's pairs).
KOG_HOST_DEVICE inline int32_t moe_row_rank(const int32_t* expert, int32_t width, int32_t i) {
  const int32_t first = i / width * width;
  int32_t r = 0;
  for (int32_t j = first; j < first + width; ++j) r += expert[j] < expert[i] || (expert[j] == expert[i] && j < i);
  return r;
}

}  // namespace kog::schedule
