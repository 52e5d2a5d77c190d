// KV append (vLLM's reshape_and_cache): copies this step's k and v rows into one layer's paged
// KV cache. Token i goes to slot slot_mapping[i] = block_id * block_size + offset; a negative
// slot marks a padding token and is skipped. Values are copied exactly when the cache has k's dtype,
// else rounded once to the cache's (kv_dtype: a bf16 / f16 cache under f32 activations).
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace kog {

struct KVAppendParams {
  void* kv_cache;               // [num_blocks, 2, n_kv_heads, block_size, head_dim] kv_dtype, contiguous:
                                //   one layer's cache, index 0 of dim 1 = K, 1 = V
  const void* k;                // [n_tokens, n_kv_heads, head_dim] dtype, token stride k_stride, heads contiguous
  const void* v;                // [n_tokens, n_kv_heads, head_dim] dtype, token stride v_stride, heads contiguous
  const int64_t* slot_mapping;  // [n_tokens] slot of each token, < num_blocks * block_size; < 0 = skip
  int64_t n_tokens;
  int64_t n_kv_heads;
  int64_t head_dim;
  int64_t block_size;           // tokens per KV block
  int64_t num_blocks;           // blocks in this layer's cache
  int64_t k_stride;             // elements between tokens of k
  int64_t v_stride;             // elements between tokens of v
  DType dtype;                  // f32, f16 or bf16: k and v
  DType kv_dtype;               // f32, f16 or bf16: kv_cache; values are rounded to it (round to nearest
                                //   even) where it is narrower, copied exactly where it is dtype
};

}  // namespace kog
