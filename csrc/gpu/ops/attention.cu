// Standalone GPU paged attention (decode and prefill; contract: csrc/ops/attention.h), built from
// the persistent kernel's work items (gpu/decode/attention_item.cuh): one launch computes the
// partials of every (query token, head, context partition), a second merges them per
// (query token, head). Query token i of sequence s sits at position seq_len - q_len + i and sees
// keys [0, position] (causal over the block table); a decode query sees its whole context.
// Prefill launches of long chunks go to the flash-style kernel instead (prefill_attention.cu).
#include "gpu/decode/attention_item.cuh"
#include "gpu/launch.h"

namespace kog::gpu {

using decode::AttnShape;
using decode::kThreads;

namespace {

// (sequence, number of keys) of query token i.
__device__ __forceinline__ void locate(const PagedAttentionParams& p, int64_t i, int64_t& seq, int64_t& kv_len) {
  if (p.query_start_loc == nullptr) {
    seq = i;
    kv_len = p.seq_lens[i];
    return;
  }
  int64_t lo = 0, hi = p.n_seqs - 1;  // last s with query_start_loc[s] <= i
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.query_start_loc[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  seq = lo;
  const int64_t q_len = p.query_start_loc[lo + 1] - p.query_start_loc[lo];
  kv_len = p.seq_lens[lo] - q_len + (i - p.query_start_loc[lo]) + 1;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) attention_partial_kernel(PagedAttentionParams p, float* partials,
                                                                     int max_parts) {
  __shared__ float smem[decode::kAttnPartialSmemFloats];
  const int64_t item = blockIdx.x;  // (token, kv head, part): the kv head's GQA group
  const int part = int(item % max_parts);
  const int64_t g = item / max_parts % p.n_kv_heads, i = item / (int64_t(max_parts) * p.n_kv_heads);
  int64_t seq, kv_len;
  locate(p, i, seq, kv_len);
  const AttnShape s{int(p.n_q_heads), int(p.n_kv_heads), int(p.head_dim), int(p.block_size), p.scale};
  // partials [n_tokens, n_q_heads, max_parts, hd + 2]: this item's part of head 0 of token i
  float* dst = partials + (i * p.n_q_heads * max_parts + part) * (p.head_dim + 2);
  decode::attn_partial_item<T>(static_cast<const T*>(p.q) + i * p.q_stride, static_cast<const T*>(p.kv_cache),
                               p.block_tables + seq * p.block_tables_stride, kv_len, int(g), dst,
                               int64_t(max_parts) * (p.head_dim + 2), s, part, decode::kAttnPartition, p.window, smem);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) attention_combine_kernel(PagedAttentionParams p, const float* partials,
                                                                     int max_parts) {
  const int64_t item = blockIdx.x;  // (token, head)
  const int64_t h = item % p.n_q_heads, i = item / p.n_q_heads;
  int64_t seq, kv_len;
  locate(p, i, seq, kv_len);
  decode::attn_combine_heads<T>(partials + item * max_parts * (p.head_dim + 2), 0, 1,
                                decode::attn_parts(kv_len, decode::kAttnPartition),
                                static_cast<T*>(p.out) + i * p.out_stride + h * p.head_dim, int(p.head_dim));
}

}  // namespace

void paged_attention(const PagedAttentionParams& p, float* partials, void* stream, GpuPrefillKernel kernel) {
  KOG_CHECK(p.head_dim <= decode::kMaxHeadDim, "paged_attention: head_dim ", p.head_dim, " > ", decode::kMaxHeadDim);
  KOG_CHECK(p.window >= 0, "paged_attention: window ", p.window, " must be >= 0");
  if (p.n_tokens == 0) return;
  if (gpu_prefill_uses_flash(p.query_start_loc == nullptr, p.max_q_len, kernel)) return prefill_attention(p, stream);
  // The split kernel reads q, K and V in 16-byte vectors (decode/attention_item.cuh).
  const int64_t elem = dtype_size(p.dtype);
  KOG_CHECK(decode::attn_vectorizable(p.head_dim, elem), "paged_attention: head_dim ", p.head_dim,
            " must be a multiple of 16 bytes for the split kernel");
  KOG_CHECK(aligned_to(p.q, 16) && aligned_to(p.kv_cache, 16) && (p.q_stride * elem) % 16 == 0,
            "paged_attention: q, its token stride and the KV cache must be 16-byte aligned");
  KOG_CHECK(partials != nullptr, "paged_attention: the split kernel needs a partials scratch buffer");
  const int max_parts = decode::attn_parts(p.max_seq_len, decode::kAttnPartition);
  const int64_t partial_items = p.n_tokens * p.n_kv_heads * max_parts, heads = p.n_tokens * p.n_q_heads;
  KOG_CHECK(partial_items < (int64_t(1) << 31), "paged_attention: too many work items for one launch");
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    // NOTE: the out may alias q: every partial reads q before the combine launch writes out.
    attention_partial_kernel<T><<<unsigned(partial_items), kThreads, 0, as_stream(stream)>>>(p, partials, max_parts);
    KOG_GPU_CHECK_LAUNCH();
    attention_combine_kernel<T><<<unsigned(heads), kThreads, 0, as_stream(stream)>>>(p, partials, max_parts);
    KOG_GPU_CHECK_LAUNCH();
  });
}

}  // namespace kog::gpu
