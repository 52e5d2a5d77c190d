// Weight staging of the persistent decode kernel: the first weight vectors of every LINEAR work
// item are loaded ahead of the item -- across the dependency waits and the small ops before it
// (weights never depend on activations) and, on NVIDIA, while the previous item computes.
//
// What a stage holds for item i of a LINEAR: for each of the warp's kLinearRowsPerWarp rows, the
// lane's first kStagedVecs 16-byte vectors (chunks lane, lane + W, ..., W the warp size): the
// vectors linear_row reads first. A lane reads only the slots it filled itself, so staging needs
// no barrier.
//   NVIDIA: kStages stages in dynamic shared memory, filled by cp.async (LDGSTS: the copy runs
//   while the lane goes on; one commit group per stage, cp.async.wait_group before the read).
//   Three stages: the item in use and the next two LINEAR items of this workgroup (192 KiB,
//   with the kernel's 33 KiB of static shared memory just inside the 227 KiB a Hopper block
//   may have).
//   AMD: one stage in registers, loaded before the wait (gfx90a/gfx940 have no asynchronous copy
//   of 16 bytes into LDS, and a CU's 64 KiB of LDS would hold little of it).
//
// Invariant the kernel keeps (persistent_kernel.cuh): every LINEAR item runs from a stage; the
// stage is looked up by (op, item) -- op indices repeat across loop steps, the weights too.
#pragma once
#include "gpu/decode/tuning.cuh"

namespace kog::gpu::decode {

template <typename T>
using WVec = Vec<T, kVec16<T>>;

#if defined(KOG_GPU_CUDA)
constexpr int kStages = 3;
constexpr int kStagedVecs = 8;  // per row and lane: 2 rows x 8 x 16 B x 256 lanes = 64 KiB a stage
#else
constexpr int kStages = 1;
constexpr int kStagedVecs = 2;  // per row and lane, in registers (4 vectors of 16 B per lane)
#endif
// Dynamic shared memory of the persistent kernel (the host sizes the launch with it).
constexpr int kStageSlots = kLinearRowsPerWarp * kStagedVecs * kThreads;  // 16-byte slots a stage
#if defined(KOG_GPU_CUDA)
constexpr int kStageSmemBytes = kStages * kStageSlots * 16;
#else
constexpr int kStageSmemBytes = 0;
#endif

__device__ __forceinline__ int linear_rows_per_item() { return kWarps * kLinearRowsPerWarp; }

static_assert(kLinearRowsPerWarp == 2, "a fused gate/up item gives each warp one gate row and its up row");

// Which weight rows a warp's two row slots take in a GEMV item.
//   kRows: consecutive rows (LINEAR).
//   kGlu (kOpLinearSiluMul): warp w of item i: output row g = i * kWarps + w, from gate row g
//     (slot 0) and up row n / 2 + g (slot 1).
//   kRopePairs (kOpLinearRopeKv): warp w of item i: RoPE pair p = i * kWarps + w of the qkv row,
//     head h = p / (hd / 2), j = p % (hd / 2): rows h * hd + j and + hd / 2 (NeoX halves) or
//     h * hd + 2j and + 1 (GPT-J pairs).
struct GemvRows {
  enum Kind : int32_t { kRows, kGlu, kRopePairs };
  int32_t kind = kRows;
  int32_t hd = 0;      // kRopePairs: head_dim
  bool neox = true;    // kRopePairs: rotate_half pairs
};

// The weight row that row slot rr (< kLinearRowsPerWarp) of this warp reads in item i of a GEMV
// over n weight rows laid out as `rows`; n when the slot has no row.
__device__ __forceinline__ int64_t gemv_weight_row(int64_t i, int rr, int64_t n, const GemvRows& rows) {
  const int warp = threadIdx.x / KOG_WARP_SIZE;
  if (rows.kind == GemvRows::kRows) {
    const int64_t row = i * linear_rows_per_item() + int64_t(warp) * kLinearRowsPerWarp + rr;
    return row < n ? row : n;
  }
  const int64_t p = i * kWarps + warp;  // one output row (kGlu) or one RoPE pair per warp
  if (p >= n / 2) return n;
  if (rows.kind == GemvRows::kGlu) return rr == 0 ? p : n / 2 + p;
  const int64_t half = rows.hd / 2, h = p / half, j = p % half;
  return h * rows.hd + (rows.neox ? j + rr * half : 2 * j + rr);
}

// What a staged item reads: n weight rows of row_bytes at w, laid out as `rows`, the item's
// place among them `item` (op item i of a LINEAR; for an expert GEMV, i's part within its group,
// w the group's expert's matrix).
struct StageSource {
  const void* w = nullptr;
  int64_t n = 0;
  int64_t row_bytes = 0;
  int64_t item = 0;
  GemvRows rows{};
};

// The per-workgroup staging state. The tags are uniform over the workgroup (every thread runs
// the same calls); the staged data is per lane.
template <typename T>
struct WeightStages {
  int32_t op[kStages];    // program op a stage holds an item of; -1: free
  int64_t item[kStages];
#if defined(KOG_GPU_CUDA)
  int32_t seq[kStages];   // commit order of each stage's cp.async group
  int32_t issued;         // groups committed so far
  uint4* slots;           // [kStages][kStageSlots] dynamic shared memory
#else
  WVec<T> reg[kLinearRowsPerWarp][kStagedVecs];
#endif

  __device__ void init(void* dynamic_smem) {
#pragma unroll
    for (int t = 0; t < kStages; ++t) op[t] = -1, item[t] = -1;
#if defined(KOG_GPU_CUDA)
    issued = 0;
#pragma unroll
    for (int t = 0; t < kStages; ++t) seq[t] = 0;
    slots = static_cast<uint4*>(dynamic_smem);
#else
    (void)dynamic_smem;
#endif
  }

  // Tags are read and written through unrolled loops with constant indices, so that they stay
  // in registers (a runtime index would put them in local memory).
  __device__ int find(int32_t o, int64_t i) const {
    int found = -1;
#pragma unroll
    for (int t = kStages - 1; t >= 0; --t)
      if (op[t] == o && item[t] == i) found = t;
    return found;
  }
  __device__ int free_stage() const {
    int found = -1;
#pragma unroll
    for (int t = kStages - 1; t >= 0; --t)
      if (op[t] < 0) found = t;
    return found;
  }
  __device__ void tag(int s, int32_t o, int64_t i) {
#pragma unroll
    for (int t = 0; t < kStages; ++t)
      if (t == s) op[t] = o, item[t] = i;
  }
#if defined(KOG_GPU_CUDA)
  __device__ int32_t seq_of(int s) const {
    int32_t q = 0;
#pragma unroll
    for (int t = 0; t < kStages; ++t)
      if (t == s) q = seq[t];
    return q;
  }
#endif

  // Starts loading item i of GEMV op o (src: its weights, 16-byte vectors of any element type)
  // into stage s (free).
  __device__ void issue(int s, int32_t o, int64_t i, const StageSource& src) {
    const int lane = threadIdx.x % KOG_WARP_SIZE;
    const int64_t n = src.n, row_bytes = src.row_bytes, chunks = row_bytes / 16;
#pragma unroll
    for (int rr = 0; rr < kLinearRowsPerWarp; ++rr) {
      const int64_t row = gemv_weight_row(src.item, rr, n, src.rows);
      const WVec<T>* wr = reinterpret_cast<const WVec<T>*>(static_cast<const char*>(src.w) + row * row_bytes);
#pragma unroll
      for (int v = 0; v < kStagedVecs; ++v) {
        const int64_t c = lane + int64_t(v) * KOG_WARP_SIZE;
        if (row < n && c < chunks) {
#if defined(KOG_GPU_CUDA)
          gpu_copy16_async(&slots[slot(s, rr, v)], wr + c);
#else
          reg[rr][v] = load16(wr + c);
#endif
        }
      }
    }
#if defined(KOG_GPU_CUDA)
    gpu_copy16_async_commit();  // one group per stage, empty or not: wait() counts on it
#pragma unroll
    for (int t = 0; t < kStages; ++t)
      if (t == s) seq[t] = issued;
    ++issued;
#endif
    tag(s, o, i);
  }

  // Before the lane reads stage s: its copies have landed.
  __device__ void wait(int s) const {
#if defined(KOG_GPU_CUDA)
    // Groups complete in commit order: those committed after stage s's may stay in flight.
    const int32_t newer = issued - 1 - seq_of(s);
    static_assert(kStages <= 3, "wait() knows 0-2 newer groups");
    if (newer <= 0) gpu_copy16_async_wait<0>();
    else if (newer == 1) gpu_copy16_async_wait<1>();
    else gpu_copy16_async_wait<2>();
#else
    (void)s;
#endif
  }

  // Vector v of row rr (of the warp's rows) of the item in stage s, as this lane staged it.
  __device__ WVec<T> get(int s, int rr, int v) const {
#if defined(KOG_GPU_CUDA)
    const uint4 raw = slots[slot(s, rr, v)];
    WVec<T> out;
    __builtin_memcpy(&out, &raw, 16);
    return out;
#else
    (void)s;
    WVec<T> out{};
#pragma unroll
    for (int r = 0; r < kLinearRowsPerWarp; ++r)  // a constant index: reg stays in registers
      if (r == rr) out = reg[r][v];
    return out;
#endif
  }

  __device__ void release(int s) { tag(s, -1, -1); }

  // Every copy landed and every stage free (before the workgroup exits: nothing may still write
  // its shared memory).
  __device__ void reset() {
#if defined(KOG_GPU_CUDA)
    gpu_copy16_async_wait<0>();
#endif
#pragma unroll
    for (int t = 0; t < kStages; ++t) op[t] = -1, item[t] = -1;
  }

#if defined(KOG_GPU_CUDA)
  // [stage][row][vector][thread]: a warp's 16-byte reads of one (row, vector) are consecutive.
  __device__ static int slot(int s, int rr, int v) {
    return ((s * kLinearRowsPerWarp + rr) * kStagedVecs + v) * kThreads + int(threadIdx.x);
  }
#endif
};

// For callers without staging (the standalone GEMV): nothing staged.
template <typename T>
struct NoStages {
  __device__ WVec<T> get(int, int, int) const { return WVec<T>{}; }
};

}  // namespace kog::gpu::decode
