// CPU paged-attention decode: one query token per sequence. Contract: csrc/ops/attention.h.
//
// Work item = (sequence, context partition, KV head); the item's rows are the GQA group of
// query heads that read this KV head, so every K/V row is loaded once for all of them.
// A sequence longer than one partition leaves unnormalized partials (acc, m, l) that a second
// pass merges with a log-sum-exp reduction; a short one writes its output directly.
#include <omp.h>

#include "cpu/ops/attention_common.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

using namespace attn;

// Below this many multiply-adds (tokens x query heads x head_dim) one thread does it all.
constexpr int64_t kParallelMinWork = 1 << 18;

template <typename T>
void decode(const PagedAttentionParams& p) {
  const int64_t D = p.head_dim, G = p.n_q_heads / p.n_kv_heads, Hkv = p.n_kv_heads;
  const int64_t part_tokens = (kAttentionPartitionTokens / p.block_size > 0
                                   ? kAttentionPartitionTokens / p.block_size : 1) * p.block_size;
  // Work list and partial slots: seq s has n_parts partitions; if more than one, its partials
  // start at part_base[s] (in units of one partition of all query heads).
  Scratch<int64_t> first_item(p.n_seqs + 1), part_base(p.n_seqs);
  int64_t n_items = 0, n_partials = 0, work = 0;
  for (int64_t s = 0; s < p.n_seqs; ++s) {
    const int64_t len = p.seq_lens[s];
    const int64_t n_parts = len > 0 ? (len + part_tokens - 1) / part_tokens : 1;
    first_item.p[s] = n_items;
    part_base.p[s] = n_parts > 1 ? n_partials : -1;
    n_items += n_parts;
    n_partials += n_parts > 1 ? n_parts : 0;
    work += len * p.n_q_heads * D;
  }
  first_item.p[p.n_seqs] = n_items;
  Scratch<int64_t> item_seq(n_items);
  for (int64_t s = 0; s < p.n_seqs; ++s)
    for (int64_t it = first_item.p[s]; it < first_item.p[s + 1]; ++it) item_seq.p[it] = s;
  // partials: [n_partials, n_q_heads, D + 2]: acc (unnormalized), then m, then l.
  const int64_t stride = D + 2;
  Scratch<float> partials(n_partials * p.n_q_heads * stride);
  const int nthreads = work >= kParallelMinWork ? omp_get_max_threads() : 1;
  const int64_t per_thread = rows_scratch(G, D);
  Scratch<float> scratch(nthreads * per_thread);
  Scratch<int64_t> limits(nthreads * G);
  const T* q_base = static_cast<const T*>(p.q);
  T* out_base = static_cast<T*>(p.out);

#pragma omp parallel num_threads(nthreads)
  {
    Rows r;
    r.n = G;
    const int tid = omp_get_thread_num();
    bind_rows(r, scratch.p + tid * per_thread, G, D, limits.p + tid * G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items * Hkv; ++w) {
      const int64_t item = w / Hkv, kvh = w % Hkv, s = item_seq.p[item];
      const int64_t part = item - first_item.p[s], len = p.seq_lens[s];
      const int64_t k_begin = part * part_tokens, k_end = min_i(len, k_begin + part_tokens);
      for (int64_t g = 0; g < G; ++g) {
        load_row(r, g, q_base + s * p.q_stride + (kvh * G + g) * D, p.scale, D);
        r.limit[g] = len - 1;
      }
      attend<T>(p, p.block_tables + s * p.block_tables_stride, kvh, k_begin, k_end, r);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        if (part_base.p[s] < 0) {
          store_row(r, g, out_base + s * p.out_stride + h * D, D);
          continue;
        }
        float* dst = partials.p + ((part_base.p[s] + part) * p.n_q_heads + h) * stride;
        __builtin_memcpy(dst, r.acc + g * D, D * sizeof(float));
        dst[D] = r.m[g];
        dst[D + 1] = r.l[g];
      }
    }
    // Merge: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p, M = max_p m_p.
#pragma omp for schedule(static)
    for (int64_t w = 0; w < p.n_seqs * p.n_q_heads; ++w) {
      const int64_t s = w / p.n_q_heads, h = w % p.n_q_heads;
      if (part_base.p[s] < 0) continue;
      const int64_t n_parts = first_item.p[s + 1] - first_item.p[s];
      const float* part0 = partials.p + (part_base.p[s] * p.n_q_heads + h) * stride;
      const int64_t part_step = p.n_q_heads * stride;
      float m_all = -__builtin_inff();
      for (int64_t i = 0; i < n_parts; ++i) m_all = max_f(m_all, part0[i * part_step + D]);
      float* acc = r.acc;  // this thread's row 0 is free now
      for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
      float l_all = 0.f;
      for (int64_t i = 0; i < n_parts; ++i) {
        const float* src = part0 + i * part_step;
        const float wgt = fast_exp(src[D] - m_all);
        l_all += wgt * src[D + 1];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += wgt * src[d];
      }
      const float inv_l = 1.f / l_all;
      T* o = out_base + s * p.out_stride + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = from_f32<T>(acc[d] * inv_l);
    }
  }
}

}  // namespace

void paged_attention_decode(const PagedAttentionParams& p) {
  dispatch_float(p.dtype, [&](auto tag) { decode<decltype(tag)>(p); });
}

}  // namespace kog::cpu::KOG_ISA_NS
