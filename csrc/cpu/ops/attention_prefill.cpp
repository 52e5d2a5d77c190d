// CPU paged-attention prefill: several query tokens per sequence (prompt chunks, speculative
// verification), causal against the cache. Contract: csrc/ops/attention.h.
//
// Work item = (sequence, tile of query tokens, KV head). Its rows are tile tokens x the GQA
// group of that KV head, so each K/V chunk is converted once and used by every row; the keys
// are walked once, in chunks, with online softmax (flash-attention style). A sequence whose
// queries fit one tile but whose context spans several partitions (speculative verification,
// a small chunk after a long prompt) would be one long work item per KV head; it goes to the
// split-context kernel of attention_decode.cpp instead, which also splits the keys.

#include "cpu/ops/attention_common.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

using namespace attn;

// Rows per work item: enough to reuse each K/V chunk, few enough to keep acc in L2.
constexpr int64_t kTargetRows = 64;
constexpr int64_t kParallelMinWork = 1 << 18;

// Query tokens per tile for this GQA group size.
static inline int64_t tile_tokens(int64_t group) { return kTargetRows / group > 0 ? kTargetRows / group : 1; }

// T: q and out; C: the cache.
template <typename T, typename C>
void prefill(const PagedAttentionParams& p, const int64_t* seqs, int64_t n_sel) {
  const int64_t D = p.head_dim, G = p.n_q_heads / p.n_kv_heads, Hkv = p.n_kv_heads;
  const int64_t tile = tile_tokens(G);
  const int64_t max_rows = tile * G;
  // Work list: the tiles of every selected sequence, tile t of seqs[x] at first_item[x] + t.
  Scratch<int64_t> first_item(n_sel + 1);
  int64_t n_items = 0, work = 0;
  for (int64_t x = 0; x < n_sel; ++x) {
    const int64_t s = seqs[x], q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    first_item.p[x] = n_items;
    n_items += (q_len + tile - 1) / tile;
    work += q_len * int64_t(p.seq_lens[s]) * p.n_q_heads * D;
  }
  first_item.p[n_sel] = n_items;
  Scratch<int64_t> item_sel(n_items);
  for (int64_t x = 0; x < n_sel; ++x)
    for (int64_t it = first_item.p[x]; it < first_item.p[x + 1]; ++it) item_sel.p[it] = x;
  ThreadPool& pool = ThreadPool::instance();
  const int nthreads = work >= kParallelMinWork ? pool.size() : 1;
  const int64_t per_thread = rows_scratch(max_rows, D);
  Scratch<float> scratch(nthreads * per_thread);
  Scratch<int64_t> limits(nthreads * max_rows);
  const T* q_base = static_cast<const T*>(p.q);
  T* out_base = static_cast<T*>(p.out);

  std::atomic<int64_t> next{0};  // work items are taken one at a time (dynamic schedule)
  pool.run(nthreads, [&](int tid, int) {
    Rows r;
    bind_rows(r, scratch.p + tid * per_thread, max_rows, D, limits.p + tid * max_rows);
    r.window = p.window;
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < n_items * Hkv;) {
      // Last tiles first: they see the most keys, so the tail of the loop is the cheap work.
      const int64_t rev = n_items * Hkv - 1 - w;
      const int64_t item = rev / Hkv, kvh = rev % Hkv, x = item_sel.p[item], s = seqs[x];
      const int64_t q_start = p.query_start_loc[s];
      const int64_t q_len = p.query_start_loc[s + 1] - q_start, len = p.seq_lens[s];
      const int64_t q0 = (item - first_item.p[x]) * tile, nq = min_i(tile, q_len - q0);
      const int64_t pos0 = len - q_len + q0;  // absolute position of the tile's first token
      r.n = nq * G;
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          load_row(r, i * G + g, q_base + (q_start + q0 + i) * p.q_stride + (kvh * G + g) * D, p.scale, D);
          r.limit[i * G + g] = pos0 + i;
        }
      // With a window no row sees a key before pos0 - window + 1 (the first row's first).
      const int64_t k_begin = p.window > 0 ? max_i(0, pos0 - p.window + 1) : 0;
      attend<C>(p, p.block_tables + s * p.block_tables_stride, kvh, k_begin, pos0 + nq, r);
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g)
          store_row(r, i * G + g, out_base + (q_start + q0 + i) * p.out_stride + (kvh * G + g) * D, D);
    }
  });
}

}  // namespace

void paged_attention_prefill(const PagedAttentionParams& p) {
  const int64_t tile = tile_tokens(p.n_q_heads / p.n_kv_heads), part = partition_tokens(p.block_size);
  Scratch<int64_t> tiled(p.n_seqs), split(p.n_seqs);
  int64_t n_tiled = 0, n_split = 0;
  for (int64_t s = 0; s < p.n_seqs; ++s) {
    const int64_t q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    if (q_len == 0) continue;
    if (q_len <= tile && p.seq_lens[s] > part) {
      split.p[n_split++] = s;
    } else {
      tiled.p[n_tiled++] = s;
    }
  }
  if (n_split > 0) paged_attention_split(p, split.p, n_split);
  if (n_tiled > 0)
    dispatch_float(p.dtype, [&](auto tag) {
      dispatch_float(p.kv_dtype, [&](auto cache_tag) { prefill<decltype(tag), decltype(cache_tag)>(p, tiled.p, n_tiled); });
    });
}

}  // namespace kog::cpu::KOG_ISA_NS
