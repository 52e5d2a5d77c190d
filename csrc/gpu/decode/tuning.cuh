// Tile sizes and occupancy of the GPU attention and decode kernels, per vendor and architecture,
// in one place.
// Device-pass values may depend on KOG_WARP_SIZE; values the host uses to size launches may not
// (one binary serves targets of both widths).
#pragma once
#include "gpu/compat.cuh"
#include "ops/attention.h"

namespace kog::gpu::decode {

// Threads of a persistent workgroup: 4 wavefronts of 64 on CDNA3 (MI300X: 304 CUs, 64 KiB LDS
// per CU), 8 warps of 32 on Hopper (H200: 132 SMs, 228 KiB shared memory per SM).
constexpr int kThreads = 256;
// Persistent workgroups per multiprocessor (capped by the occupancy the runtime reports).
constexpr int kBlocksPerMultiprocessor = 2;
constexpr int kMaxBatch = 8;          // sequences in one step
constexpr int kMaxHeadDim = 256;
constexpr int kAttnPartition = int(kGpuAttentionPartitionTokens);  // cached tokens per attention item
// The persistent kernel halves the partition down to this for short contexts, until the
// attention has two items per workgroup (a 1k context at batch 1 would leave most idle).
constexpr int kMinAttnPartition = 16;
// Output rows of one LINEAR work item per warp: more rows, fewer dependency checks; fewer rows,
// more work items to spread over the multiprocessors (the LM head has 49k-128k rows).
constexpr int kLinearRowsPerWarp = 2;
// Small ops split a batch row into items (small_items.cuh): kRowChunk elements of EMBED,
// RMS_NORM and SILU_MUL (hidden 2048: 4 items per row, intermediate 8192: 16), kRopeHeads heads
// of ROPE, one KV head of KV_APPEND, kWarps heads of QK_NORM.
constexpr int kRowChunk = 512;
constexpr int kRopeHeads = 4;
// 16-byte weight vectors a lane loads before their math in the GEMV's main loop (bytes in
// flight: x 16 x kThreads per workgroup): batch 1 streams 8 (32 KiB per workgroup); batches of
// 2-8 stream 2, their 8 rows of x taking the registers (4 would spill in the GEMV on sm_90a).
constexpr int kLinearUnrollBatch1 = 8;
constexpr int kLinearUnroll = 2;

// Device code only: KOG_WARP_SIZE is a property of the device pass.
constexpr int kWarps = kThreads / KOG_WARP_SIZE;
static_assert(kThreads % kMaxWarpSize == 0, "whole warps on every target");

}  // namespace kog::gpu::decode

// ---- flash-style prefill attention (gpu/ops/prefill_attention.cuh) -----------------------------
// The host sizes the grid by Tile<>::kRows, so these may differ per vendor (KOG_GPU_HIP is defined
// in both passes) but not per architecture of one vendor (one binary serves several).
namespace kog::gpu::prefill {

constexpr int kThreads = 256;
// Threads sharing one query row: a 16-lane shuffle group, inside one warp on every target.
constexpr int kRowLanes = 16;
constexpr int kRowGroups = kThreads / kRowLanes;
constexpr int64_t kMinQueryLen = kGpuFlashPrefillMinQueryLen;  // dispatch threshold (ops/attention.h)

// Per padded head dim kD: kRows query rows ((token, head of the GQA group) pairs) per workgroup
// and kKeys keys per K/V tile. Shared memory holds the scaled Q tile, one K-or-V tile (f32, rows
// padded by one float) and the kRows x kKeys probabilities: (kRows + kKeys)(kD + 1) + kRows
// (kKeys + 1) floats, within 48 KiB of static shared memory on NVIDIA and 64 KiB of LDS per
// workgroup on CDNA. Per thread: kRows / 16 rows x kD / 16 output columns of fp32 accumulators.
template <int kD>
struct Tile;
template <>
struct Tile<64> {
  static constexpr int kRows = 64, kKeys = 32;  // 33.4 KB
};
template <>
struct Tile<128> {
  static constexpr int kRows = 32, kKeys = 32;  // 37.2 KB
};
#if defined(KOG_GPU_HIP)
template <>
struct Tile<256> {
  static constexpr int kRows = 32, kKeys = 16;  // 51.5 KB of the 64 KiB LDS
};
constexpr int kSharedBytesLimit = 64 * 1024;
#else
template <>
struct Tile<256> {
  static constexpr int kRows = 16, kKeys = 16;  // 34 KB (32 rows would pass the 48 KiB static limit)
};
constexpr int kSharedBytesLimit = 48 * 1024;
#endif

template <int kD>
constexpr int shared_floats() {
  return (Tile<kD>::kRows + Tile<kD>::kKeys) * (kD + 1) + Tile<kD>::kRows * (Tile<kD>::kKeys + 1);
}
static_assert(shared_floats<64>() * 4 <= kSharedBytesLimit && shared_floats<128>() * 4 <= kSharedBytesLimit &&
                  shared_floats<256>() * 4 <= kSharedBytesLimit,
              "prefill tiles fit in shared memory");

}  // namespace kog::gpu::prefill
