// Paged attention over one layer's KV cache, one params struct for the decode and the prefill
// (chunked prefill, multi-token verification) kernels of every backend.
//
// Sequence s owns query tokens [query_start_loc[s], query_start_loc[s+1]) of q (q_len of them;
// decode: exactly one, token s) and seq_lens[s] cached tokens, this step's included. Its query
// token i sits at absolute position seq_len - q_len + i and attends causally to the cached
// positions <= that one. Cached token t lives in block block_tables[s][t / block_size] at
// offset t % block_size. Query head h reads KV head h / (n_q_heads / n_kv_heads) (GQA).
// With window > 0 (a sliding-window layer) a query at position t sees only the cached positions
// in (t - window, t] (HF's sliding_window: key j visible iff t - window < j <= t).
//   out = softmax(scale * q k^T) v, softmax and accumulation in fp32, one rounding to dtype.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace kog {

struct PagedAttentionParams {
  void* out;                       // [n_tokens, n_q_heads, head_dim] dtype, token stride out_stride, heads
                                   //   contiguous; may alias q
  const void* q;                   // [n_tokens, n_q_heads, head_dim] dtype, token stride q_stride, heads contiguous
  const void* kv_cache;            // [num_blocks, 2, n_kv_heads, block_size, head_dim] kv_dtype, contiguous:
                                   //   one layer (index 0 of dim 1 = K, 1 = V)
  const int32_t* block_tables;     // [n_seqs, max_blocks_per_seq] physical block ids, row stride
                                   //   block_tables_stride; entries past a sequence's last block are ignored
  const int32_t* seq_lens;         // [n_seqs] cached tokens per sequence incl. this step's, >= q_len
  const int32_t* query_start_loc;  // [n_seqs + 1] cumulative query counts, first 0, last n_tokens;
                                   //   nullptr = decode: one query per sequence, n_tokens == n_seqs
  int64_t n_seqs;                  // sequences: rows of block_tables, entries of seq_lens
  int64_t n_tokens;                // query tokens in q and out
  int64_t n_q_heads;               // a multiple of n_kv_heads
  int64_t n_kv_heads;              // KV heads of the cache; query head h reads h / (n_q_heads / n_kv_heads)
  int64_t head_dim;                // a multiple of 16, <= 256
  int64_t block_size;              // tokens per KV block
  int64_t num_blocks;              // blocks in this layer's cache: block ids are < num_blocks
  int64_t max_blocks_per_seq;      // columns of block_tables
  int64_t block_tables_stride;     // elements between rows of block_tables
  int64_t q_stride;                // elements between tokens of q
  int64_t out_stride;              // elements between tokens of out
  int64_t max_seq_len;             // max(seq_lens), known on the host: sizes split-context work
  int64_t max_q_len;               // max query tokens of one sequence (1 for decode): picks the GPU
                                   //   prefill kernel and sizes the flash kernel's grid
  float scale;                     // softmax scale, usually head_dim^-0.5
  DType dtype;                     // f32, f16 or bf16: q and out
  DType kv_dtype;                  // f32, f16 or bf16: kv_cache (the CPU kernels take any pair; the GPU's
                                   //   kv_dtype == dtype). Keys and values widen to fp32 in registers.
  int64_t window = 0;              // 0: causal over the whole context; else the last `window` positions
                                   //   up to the query's own
};

// Kernels split a sequence's context into partitions of this many tokens (rounded to whole
// blocks), computed in parallel and merged by log-sum-exp (FlashDecoding), so a single long
// sequence keeps every core busy.
constexpr int64_t kAttentionPartitionTokens = 512;
// The CPU split kernel uses all threads from this many multiply-adds (context tokens x query
// heads x head_dim, summed over the batch); below it one thread does the whole call.
constexpr int64_t kCpuAttentionParallelMinWork = 1 << 18;
// The GPU kernels' partition (gpu/decode/tuning.cuh): sizes their [tokens, heads, partitions,
// head_dim + 2] f32 scratch, which the caller allocates.
constexpr int64_t kGpuAttentionPartitionTokens = 256;

// Which GPU kernel computes a prefill launch: kAuto picks by gpu_prefill_uses_flash; the others
// force one (tests compare both paths). Decode always takes the split kernel.
enum class GpuPrefillKernel : int { kAuto = 0, kSplit = 1, kFlash = 2 };
// A prefill launch whose longest chunk has at least this many query tokens takes the flash-style
// prefill kernel (gpu/ops/prefill_attention.cuh: query tiles share each K/V tile load, no
// scratch); shorter chunks (speculative verification, small tails) keep the split kernel, whose
// partitions of the context keep the multiprocessors busy with few queries.
constexpr int64_t kGpuFlashPrefillMinQueryLen = 16;

inline bool gpu_prefill_uses_flash(bool decode, int64_t max_q_len, GpuPrefillKernel kernel) {
  if (decode || kernel == GpuPrefillKernel::kSplit) return false;
  return kernel == GpuPrefillKernel::kFlash || max_q_len >= kGpuFlashPrefillMinQueryLen;
}

// Floats of that scratch for n_tokens queries of n_q_heads heads over at most max_seq_len keys;
// 0 when the launch takes the flash prefill kernel, which needs none.
inline int64_t gpu_attention_partials_floats(int64_t n_tokens, int64_t n_q_heads, int64_t head_dim,
                                             int64_t max_seq_len, bool decode = true, int64_t max_q_len = 1,
                                             GpuPrefillKernel kernel = GpuPrefillKernel::kAuto) {
  if (gpu_prefill_uses_flash(decode, max_q_len, kernel)) return 0;
  const int64_t parts = (max_seq_len + kGpuAttentionPartitionTokens - 1) / kGpuAttentionPartitionTokens;
  return n_tokens * n_q_heads * parts * (head_dim + 2);
}

}  // namespace kog
