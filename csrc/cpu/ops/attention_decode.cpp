// CPU paged attention for sequences with few query tokens over a long context: decode (one
// token) and, called from attention_prefill.cpp, short chunks such as speculative
// verification. Contract: csrc/ops/attention.h.
//
// Work item = (sequence, context partition, KV head); its rows are the sequence's query tokens
// x the GQA group of query heads that read this KV head, so every K/V row is loaded once for
// all of them. A sequence longer than one partition leaves unnormalized partials (acc, m, l)
// per row and partition that a second pass merges with a log-sum-exp reduction
// (FlashDecoding); a short one writes its output directly.

#include "cpu/ops/attention_common.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

using namespace attn;

// Tokens per context partition: kAttentionPartitionTokens, halved (in whole blocks) while the
// work items (sequences x partitions x KV heads) would leave threads without two items each,
// e.g. one sequence over 3 KV heads on 2 threads. Results equal for any partition size up to
// float reassociation (the merge is exact log-sum-exp).
int64_t balanced_partition_tokens(const PagedAttentionParams& p, const int64_t* seqs, int64_t n_sel, int nthreads) {
  int64_t part = partition_tokens(p.block_size);
  const int64_t min_part = 4 * p.block_size > 64 ? 4 * p.block_size : 64;
  auto items = [&](int64_t pt) {
    int64_t n = 0;
    for (int64_t x = 0; x < n_sel; ++x) {
      const int64_t len = p.seq_lens[seqs[x]];
      n += (len > 0 ? (len + pt - 1) / pt : 1) * p.n_kv_heads;
    }
    return n;
  };
  while (nthreads > 1 && part / 2 >= min_part && items(part) < 2 * int64_t(nthreads))
    part = (part / 2 + p.block_size - 1) / p.block_size * p.block_size;
  return part;
}

// T: q and out; C: the cache.
template <typename T, typename C>
void split_context(const PagedAttentionParams& p, const int64_t* seqs, int64_t n_sel) {
  const int64_t D = p.head_dim, G = p.n_q_heads / p.n_kv_heads, Hkv = p.n_kv_heads;
  const int64_t Hq = p.n_q_heads;
  const int32_t* qsl = p.query_start_loc;  // nullptr: decode, sequence s owns q row s
  int64_t work = 0;
  for (int64_t x = 0; x < n_sel; ++x) {
    const int64_t s = seqs[x];
    work += int64_t(p.seq_lens[s]) * (qsl ? qsl[s + 1] - qsl[s] : 1) * Hq * D;
  }
  ThreadPool& pool = ThreadPool::instance();
  const int nthreads = work >= kCpuAttentionParallelMinWork && !ThreadPool::in_region() ? pool.size() : 1;
  const int64_t part_tokens = balanced_partition_tokens(p, seqs, n_sel, nthreads);
  // Work list and partial slots: selected sequence x has n_parts partitions (items
  // first_item[x] ..); if more than one, the partials of its row i in partition k are
  // partial row part_base[x] + k * q_len + i.
  Scratch<int64_t> first_item(n_sel + 1), part_base(n_sel);
  int64_t n_items = 0, n_partial_rows = 0, max_q = 1;
  for (int64_t x = 0; x < n_sel; ++x) {
    const int64_t s = seqs[x], len = p.seq_lens[s];
    const int64_t q_len = qsl ? qsl[s + 1] - qsl[s] : 1;
    const int64_t n_parts = len > 0 ? (len + part_tokens - 1) / part_tokens : 1;
    first_item.p[x] = n_items;
    part_base.p[x] = n_parts > 1 ? n_partial_rows : -1;
    n_items += n_parts;
    n_partial_rows += n_parts > 1 ? n_parts * q_len : 0;
    max_q = q_len > max_q ? q_len : max_q;
  }
  first_item.p[n_sel] = n_items;
  Scratch<int64_t> item_sel(n_items);
  for (int64_t x = 0; x < n_sel; ++x)
    for (int64_t it = first_item.p[x]; it < first_item.p[x + 1]; ++it) item_sel.p[it] = x;
  // partials: [n_partial_rows, n_q_heads, D + 2]: acc (unnormalized), then m, then l.
  const int64_t stride = D + 2;
  Scratch<float> partials(n_partial_rows * Hq * stride);
  const int64_t max_rows = max_q * G, per_thread = rows_scratch(max_rows, D);
  Scratch<float> scratch(nthreads * per_thread);
  Scratch<int64_t> limits(nthreads * max_rows);
  const T* q_base = static_cast<const T*>(p.q);
  T* out_base = static_cast<T*>(p.out);

  // Work item w = (item, KV head): its query rows attend to the item's partition, written
  // out directly or as partials for the merge.
  auto attend_item = [&](int64_t w, Rows& r) {
    const int64_t item = w / Hkv, kvh = w % Hkv, x = item_sel.p[item], s = seqs[x];
    const int64_t part = item - first_item.p[x], len = p.seq_lens[s];
    const int64_t q_start = qsl ? qsl[s] : s, q_len = qsl ? qsl[s + 1] - q_start : 1;
    const int64_t k_begin = part * part_tokens;
    const int64_t k_end = min_i(len, k_begin + part_tokens);
    r.n = q_len * G;
    for (int64_t i = 0; i < q_len; ++i)
      for (int64_t g = 0; g < G; ++g) {
        load_row(r, i * G + g, q_base + (q_start + i) * p.q_stride + (kvh * G + g) * D, p.scale, D);
        r.limit[i * G + g] = len - q_len + i;
      }
    attend<C>(p, p.block_tables + s * p.block_tables_stride, kvh, k_begin, k_end, r);
    for (int64_t i = 0; i < q_len; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = i * G + g, h = kvh * G + g;
        if (part_base.p[x] < 0) {
          store_row(r, row, out_base + (q_start + i) * p.out_stride + h * D, D);
          continue;
        }
        // A partition past a row's position leaves l = 0, m = -inf: weight 0 in the merge.
        float* dst = partials.p + ((part_base.p[x] + part * q_len + i) * Hq + h) * stride;
        __builtin_memcpy(dst, r.acc + row * D, D * sizeof(float));
        dst[D] = r.m[row];
        dst[D + 1] = r.l[row];
      }
  };
  // Merge of (sequence, head) w: out = sum_k e^(m_k - M) acc_k / sum_k e^(m_k - M) l_k,
  // M = max_k m_k. acc: D floats of scratch.
  auto merge_head = [&](int64_t w, float* acc) {
    const int64_t x = w / Hq, h = w % Hq, s = seqs[x];
    if (part_base.p[x] < 0) return;
    const int64_t q_start = qsl ? qsl[s] : s, q_len = qsl ? qsl[s + 1] - q_start : 1;
    const int64_t n_parts = first_item.p[x + 1] - first_item.p[x];
    const int64_t part_step = q_len * Hq * stride;
    for (int64_t i = 0; i < q_len; ++i) {
      const float* part0 = partials.p + ((part_base.p[x] + i) * Hq + h) * stride;
      float m_all = -__builtin_inff();
      for (int64_t k = 0; k < n_parts; ++k) m_all = max_f(m_all, part0[k * part_step + D]);
      for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
      float l_all = 0.f;
      for (int64_t k = 0; k < n_parts; ++k) {
        const float* src = part0 + k * part_step;
        const float wgt = fast_exp(src[D] - m_all);
        l_all += wgt * src[D + 1];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += wgt * src[d];
      }
      const float inv_l = 1.f / l_all;
      T* o = out_base + (q_start + i) * p.out_stride + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = from_f32<T>(acc[d] * inv_l);
    }
  };
  // One thread: no region at all. The decode executor calls this from one thread of its own
  // region, where even a nested region of one thread costs ~1.2 us (libgomp).
  if (nthreads == 1) {
    Rows r;
    bind_rows(r, scratch.p, max_rows, D, limits.p);
    r.window = p.window;
    for (int64_t w = 0; w < n_items * Hkv; ++w) attend_item(w, r);
    for (int64_t w = 0; w < n_sel * Hq; ++w) merge_head(w, r.acc);  // row 0 is free now
    return;
  }
  // Work items are taken one at a time (dynamic schedule); a barrier between the two loops.
  std::atomic<int64_t> next_item{0}, next_head{0};
  pool.run(nthreads, [&](int tid, int) {
    Rows r;
    bind_rows(r, scratch.p + tid * per_thread, max_rows, D, limits.p + tid * max_rows);
    r.window = p.window;
    for (int64_t w; (w = next_item.fetch_add(1, std::memory_order_relaxed)) < n_items * Hkv;) attend_item(w, r);
    pool.barrier();
    for (int64_t w; (w = next_head.fetch_add(1, std::memory_order_relaxed)) < n_sel * Hq;)
      merge_head(w, r.acc);  // this thread's row 0 is free now
  });
}

}  // namespace

void paged_attention_split(const PagedAttentionParams& p, const int64_t* seqs, int64_t n_seqs) {
  dispatch_float(p.dtype, [&](auto tag) {
    dispatch_float(p.kv_dtype, [&](auto cache_tag) {
      split_context<decltype(tag), decltype(cache_tag)>(p, seqs, n_seqs);
    });
  });
}

void paged_attention_decode(const PagedAttentionParams& p) {
  Scratch<int64_t> all(p.n_seqs);
  for (int64_t s = 0; s < p.n_seqs; ++s) all.p[s] = s;
  paged_attention_split(p, all.p, p.n_seqs);
}

}  // namespace kog::cpu::KOG_ISA_NS
