// Host launcher of the flash-style prefill attention (kernel: prefill_attention.cuh). Picks the
// instantiation for the padded head dim: 64 and 128 (the common heads) and a generic 256 path
// for every other multiple of 16 (80, 96, 192, 256, ...: rows past head_dim are zeros).
#include <climits>

#include "gpu/launch.h"
#include "gpu/ops/prefill_attention.cuh"

namespace kog::gpu {

namespace {

template <typename T, int kD>
void launch(const PagedAttentionParams& p, gpuStream_t stream) {
  const int64_t rows = p.max_q_len * (p.n_q_heads / p.n_kv_heads);
  const int64_t tiles = (rows + prefill::Tile<kD>::kRows - 1) / prefill::Tile<kD>::kRows;
  const int64_t workgroups = tiles * p.n_seqs * p.n_kv_heads;
  KOG_CHECK(workgroups <= INT_MAX, "prefill_attention: ", workgroups, " workgroups exceed one launch");
  prefill::prefill_attention_kernel<T, kD><<<unsigned(workgroups), prefill::kThreads, 0, stream>>>(p);
  KOG_GPU_CHECK_LAUNCH();
}

}  // namespace

bool prefill_attention_supported(const PagedAttentionParams& p) {
  return p.query_start_loc != nullptr && p.head_dim % 16 == 0 && p.head_dim <= 256 &&
         aligned_to(p.kv_cache, 16) && p.max_seq_len < INT_MAX;
}

void prefill_attention(const PagedAttentionParams& p, void* stream) {
  KOG_CHECK(prefill_attention_supported(p), "prefill_attention: needs query_start_loc, head_dim a multiple of 16 ",
            "up to 256 and a 16-byte aligned cache (head_dim ", p.head_dim, ")");
  if (p.n_tokens == 0 || p.max_q_len == 0) return;
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.head_dim <= 64) launch<T, 64>(p, as_stream(stream));
    else if (p.head_dim <= 128) launch<T, 128>(p, as_stream(stream));
    else launch<T, 256>(p, as_stream(stream));
  });
}

}  // namespace kog::gpu
