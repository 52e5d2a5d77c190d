// Tile sizes and occupancy of the GPU decode kernels, per vendor and architecture, in one place.
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
constexpr int kMaxGroup = 16;         // query heads per KV head (GQA group)
constexpr int kAttnPartition = int(kGpuAttentionPartitionTokens);  // cached tokens per attention item
// Output rows of one LINEAR work item per warp: more rows, fewer dependency checks; fewer rows,
// more work items to spread over the multiprocessors (the LM head has 49k-128k rows).
constexpr int kLinearRowsPerWarp = 2;
// 16-byte weight vectors each lane loads into registers before it waits on the previous op:
// the weight stream of the next op is in flight while the current op finishes elsewhere.
constexpr int kPrefetchVecs = 4;

// Device code only: KOG_WARP_SIZE is a property of the device pass.
constexpr int kWarps = kThreads / KOG_WARP_SIZE;
static_assert(kThreads % kMaxWarpSize == 0, "whole warps on every target");

}  // namespace kog::gpu::decode
