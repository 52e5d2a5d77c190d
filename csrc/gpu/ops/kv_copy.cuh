// GPU copy of (layer, block) KV slabs: copy-on-write inside the device pool, and swap between
// the device pool and the pinned host pool (read or written through its mapped device address).
// Contract: csrc/kvcache/kv_copy.h (BlockCopyParams); launcher: kv_copy.cu.
#pragma once
#include <cstdint>

#include "gpu/compat.cuh"

namespace kog::gpu {

constexpr int kKvCopyThreads = 256;

// One workgroup per (layer, pair) slab, grid-strided; each thread moves W-byte words
// (W = 16 when every slab start is 16-byte aligned, else 1).
// pairs: [n_pairs, 2] (src block, dst block), device-readable.
template <typename Word>
__global__ void __launch_bounds__(kKvCopyThreads)
kv_copy_blocks_kernel(uint8_t* dst, const uint8_t* src, const int32_t* pairs, int64_t n_pairs,
                      int64_t num_layers, int64_t dst_num_blocks, int64_t src_num_blocks,
                      int64_t slab_bytes) {
  const int64_t n_words = slab_bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t w = blockIdx.x; w < num_layers * n_pairs; w += gridDim.x) {
    const int64_t layer = w / n_pairs, i = w % n_pairs;
    const int64_t s = pairs[2 * i], d = pairs[2 * i + 1];
    const Word* from = reinterpret_cast<const Word*>(src + (layer * src_num_blocks + s) * slab_bytes);
    Word* to = reinterpret_cast<Word*>(dst + (layer * dst_num_blocks + d) * slab_bytes);
    for (int64_t j = threadIdx.x; j < n_words; j += blockDim.x) to[j] = from[j];
  }
}

}  // namespace kog::gpu
