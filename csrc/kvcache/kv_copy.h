// CPU data movement for the paged KV layout: batched block copies between two KV tensors
// (or within one), used for copy-on-write, swap-out and swap-in.
//
// LAYOUT: a KV tensor is [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]
// (index 0 = K, 1 = V), so one block of one layer is a contiguous slab of
// slab_bytes = 2 * num_kv_heads * block_size * head_dim * element size. The host swap pool has
// the same layout with its own num_blocks.
#pragma once
#include <cstdint>

namespace kog::kv {

struct BlockCopyParams {
  void* dst;                 // [num_layers, dst_num_blocks, slab_bytes] bytes
  const void* src;           // [num_layers, src_num_blocks, slab_bytes] bytes (may alias dst)
  int64_t num_layers;
  int64_t dst_num_blocks;
  int64_t src_num_blocks;
  int64_t slab_bytes;        // bytes of one (layer, block) slab
  const int32_t* pairs;      // [n_pairs, 2] (src block, dst block)
  int64_t n_pairs;
};

// Checks every block id is in range and that no destination is written twice or, for an
// in-place copy, also read. Throws kog::Error(kInvalidArgument); `pairs` must be host memory.
void validate_block_copy(const BlockCopyParams& p);

// validate_block_copy, then copies all (layer, pair) slabs in parallel (OpenMP).
void copy_blocks_cpu(const BlockCopyParams& p);

}  // namespace kog::kv
