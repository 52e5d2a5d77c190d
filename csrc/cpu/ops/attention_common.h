// Shared core of the CPU paged-attention kernels (attention_decode.cpp, attention_prefill.cpp):
// a block of query rows that read one KV head attends to a range of cached keys with online
// softmax in fp32. Included only by per-ISA kernel sources: everything is ISA-local.
#pragma once
#include "cpu/kernels.h"
#include "cpu/vec.h"

namespace kog::cpu::KOG_ISA_NS {
namespace attn {

// head_dim is a multiple of kLanes, so a row is a whole number of vectors in every ISA build.
constexpr int kLanes = 16;
// Keys scored together: one chunk never crosses a KV block.
constexpr int64_t kKeyChunk = 32;
// Tokens per context partition of the split kernel: kAttentionPartitionTokens in whole blocks.
static inline int64_t partition_tokens(int64_t block_size) {
  const int64_t blocks = kAttentionPartitionTokens / block_size;
  return (blocks > 0 ? blocks : 1) * block_size;
}
// Query rows that share one pass over a K/V chunk in registers.
constexpr int kMaxRowBlock = 4;

static inline float max_f(float a, float b) { return a > b ? a : b; }
static inline int64_t min_i(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max_i(int64_t a, int64_t b) { return a > b ? a : b; }

// Heap scratch freed on scope exit (std::unique_ptr would be a template shared across ISAs).
template <typename T>
struct Scratch {
  T* p;
  explicit Scratch(int64_t n) : p(new T[n > 0 ? n : 1]) {}
  ~Scratch() { delete[] p; }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// State of n query rows of one KV head, each with the last key position it may see.
struct Rows {
  int64_t n = 0;
  float* q = nullptr;        // [n, head_dim] query * scale
  float* acc = nullptr;      // [n, head_dim] sum of p * v, not yet divided by l
  float* m = nullptr;        // [n] running max of the scores
  float* l = nullptr;        // [n] running sum of exp(score - m)
  int64_t* limit = nullptr;  // [n] last key position each row attends to
  int64_t window = 0;        // > 0: row i attends only to positions > limit[i] - window
  float* s = nullptr;        // [n, kKeyChunk] scores, then probabilities, of one key chunk
  float* kbuf = nullptr;     // [kKeyChunk, head_dim] K chunk as fp32 (non-f32 caches)
  float* vbuf = nullptr;     // [kKeyChunk, head_dim] V chunk as fp32
};

// Floats of scratch a Rows of max_rows rows needs (bind_rows carves them).
static inline int64_t rows_scratch(int64_t max_rows, int64_t head_dim) {
  return max_rows * (2 * head_dim + 2 + kKeyChunk) + 2 * kKeyChunk * head_dim;
}

static inline void bind_rows(Rows& r, float* buf, int64_t max_rows, int64_t head_dim, int64_t* limit) {
  r.q = buf;
  r.acc = r.q + max_rows * head_dim;
  r.m = r.acc + max_rows * head_dim;
  r.l = r.m + max_rows;
  r.s = r.l + max_rows;
  r.kbuf = r.s + max_rows * kKeyChunk;
  r.vbuf = r.kbuf + kKeyChunk * head_dim;
  r.limit = limit;
}

// Row i of r gets q_row(i) * scale; acc, m and l start empty.
template <typename T>
static inline void load_row(Rows& r, int64_t i, const T* q, float scale, int64_t head_dim) {
  float* dst = r.q + i * head_dim;
  float* acc = r.acc + i * head_dim;
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) {
    dst[d] = to_f32(q[d]) * scale;
    acc[d] = 0.f;
  }
  r.m[i] = -__builtin_inff();
  r.l[i] = 0.f;
}


// Register-blocked micro-kernels on GCC vector types: one source, the vector width of each ISA
// build (4 lanes generic SSE2, 8 AVX2, 16 AVX-512), with intrinsics only where GCC's generic code
// is poor (bf16 widening, horizontal sums and max). Blocks are sized to fit 16 registers.
// K and V are read either straight from the cache (S = the cache type, widened in registers:
// decode, where each K/V row meets at most kMaxRowBlock query rows) or from an fp32 copy of the
// chunk (S = float: prefill, where many row blocks re-read it).
#if defined(__AVX512F__)
constexpr int kVec = 16;
#elif defined(__AVX2__)
constexpr int kVec = 8;
#else
constexpr int kVec = 4;
#endif
static_assert(kLanes % kVec == 0, "head_dim must be a whole number of vectors");
typedef float vfloat __attribute__((vector_size(kVec * sizeof(float))));

static inline vfloat load_v(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
// bf16 is the top half of an fp32: zero-extend to 32 bits and shift.
static inline vfloat load_v(const bf16_t* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
  return (vfloat)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  typedef uint16_t vu16 __attribute__((vector_size(kVec * sizeof(uint16_t))));
  typedef uint32_t vu32 __attribute__((vector_size(kVec * sizeof(uint32_t))));
  vu16 h;
  __builtin_memcpy(&h, p, sizeof h);
  const vu32 w = __builtin_convertvector(h, vu32) << 16;
  vfloat v;
  __builtin_memcpy(&v, &w, sizeof v);
  return v;
#endif
}
// f16 through F16C's vcvtph2ps (GCC's generic conversion of a _Float16 vector is per element).
static inline vfloat load_v(const f16_t* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__F16C__)
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  typedef f16_t vf16 __attribute__((vector_size(kVec * sizeof(f16_t))));
  vf16 h;
  __builtin_memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vfloat);
#endif
}
static inline void store_v(float* p, vfloat v) { __builtin_memcpy(p, &v, sizeof v); }

// n cache elements as fp32: src itself, or widened into buf (n a multiple of kVec: whole rows).
static inline const float* as_f32(const float* src, int64_t, float*) { return src; }
template <typename T>
static inline const float* as_f32(const T* src, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; i += kVec) store_v(buf + i, load_v(src + i));
  return buf;
}
// Sum / max of the lanes of v (halving shuffles on AVX2 and AVX-512).
static inline float hsum(vfloat v) {
#if defined(__AVX2__)
  return reduce_add(v);
#else
  float s = 0.f;
  for (int l = 0; l < kVec; ++l) s += v[l];
  return s;
#endif
}
static inline float hmax(vfloat v) {
#if defined(__AVX2__)
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
#endif
#else
  float m = v[0];
  for (int l = 1; l < kVec; ++l) m = v[l] > m ? v[l] : m;
  return m;
#endif
}
// out[j] = hsum(v[j]) for four vectors at once (three horizontal adds instead of four
// lane-by-lane reductions).
static inline void hsum4(const vfloat* v, float* out) {
#if defined(__AVX2__)
  __m256 h[4];
  for (int j = 0; j < 4; ++j) {
#if defined(__AVX512F__)
    const __m512 x = (__m512)v[j];
    h[j] = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
#else
    h[j] = (__m256)v[j];
#endif
  }
  // [v0 01, v0 23, v1 01, v1 23 | v0 45, ...], then [v0 0-3, v1 0-3, v2 0-3, v3 0-3 | 4-7 of each].
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
  for (int j = 0; j < 4; ++j) out[j] = hsum(v[j]);
#endif
}

// The next chunk's K or V rows, prefetched a slice at a time while this chunk's keys are used:
// a burst of all its lines at once would fill the miss buffers and stall the core until they
// arrive, where slices keep a few misses in flight under the compute.
struct ChunkPrefetch {
  const char* p = nullptr;  // nullptr: nothing to prefetch
  int64_t bytes = 0;
  // Lines of [j0 / n, j1 / n) of the range; key j1 = n ends it.
  void part(int64_t j0, int64_t j1, int64_t n) const {
    if (!p) return;
    for (int64_t b = j0 * bytes / n / 64 * 64; b < j1 * bytes / n; b += 64) __builtin_prefetch(p + b);
  }
};

// s[i][j] = q_i . k_j for RB query rows and KB keys (both with row stride D); s row stride kKeyChunk.
// RB x KB accumulators + one K vector stay in registers (q is a memory operand).
template <int RB, int KB, typename S>
static inline void score_block(const float* q, const S* k, int64_t D, float* s) {
  vfloat acc[RB][KB];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < KB; ++j) acc[i][j] = vfloat{};
  for (int64_t d = 0; d < D; d += kVec) {
    for (int j = 0; j < KB; ++j) {
      const vfloat kv = load_v(k + j * D + d);
      for (int i = 0; i < RB; ++i) acc[i][j] += load_v(q + i * D + d) * kv;
    }
  }
  for (int i = 0; i < RB; ++i) {
    if constexpr (KB == 4) {
      hsum4(acc[i], s + i * kKeyChunk);
    } else {
      for (int j = 0; j < KB; ++j) s[i * kKeyChunk + j] = hsum(acc[i][j]);
    }
  }
}

template <int RB, typename S>
static inline void score_rows(const float* q, const S* k, int64_t n, int64_t D, float* s, const ChunkPrefetch& pf) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    pf.part(j, j + 4, n);
    score_block<RB, 4>(q, k + j * D, D, s + j);
  }
  for (; j < n; ++j) {
    pf.part(j, j + 1, n);
    score_block<RB, 1>(q, k + j * D, D, s + j);
  }
}

// Scores of rb <= kMaxRowBlock rows in register blocks of at most 3 rows (3 x 4 accumulators).
template <typename S>
static inline void score_any(const float* q, const S* k, int64_t n, int64_t D, float* s, int64_t rb,
                             const ChunkPrefetch& pf) {
  const ChunkPrefetch none;
  int64_t i = 0;
  for (; i + 3 <= rb; i += 3) score_rows<3>(q + i * D, k, n, D, s + i * kKeyChunk, i == 0 ? pf : none);
  if (rb - i == 2) score_rows<2>(q + i * D, k, n, D, s + i * kKeyChunk, i == 0 ? pf : none);
  if (rb - i == 1) score_rows<1>(q + i * D, k, n, D, s + i * kKeyChunk, i == 0 ? pf : none);
}

// acc_i = alpha_i acc_i + sum_j p_ij v_j on DV vectors of columns from d0, for RB rows. With
// U = 2, even and odd keys go to separate accumulators: twice the independent FMA chains, so
// few rows wait on FMA throughput rather than latency (2 x RB x DV + DV + 1 registers).
template <int RB, int DV, int U, typename S>
static inline void pv_block(float* acc, const float* p, const float* alpha, const S* v,
                            int64_t n, int64_t D, int64_t d0, const ChunkPrefetch& pf) {
  vfloat a[U][RB][DV];
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < DV; ++c) {
      a[0][i][c] = load_v(acc + i * D + d0 + c * kVec) * alpha[i];
      for (int u = 1; u < U; ++u) a[u][i][c] = vfloat{};
    }
  int64_t j = 0;
  for (; j + U <= n; j += U) {
    pf.part(j, j + U, n);
    for (int u = 0; u < U; ++u) {  // one key's V vectors live at a time: no spill at 3 rows
      vfloat vv[DV];
      for (int c = 0; c < DV; ++c) vv[c] = load_v(v + (j + u) * D + d0 + c * kVec);
      for (int i = 0; i < RB; ++i) {
        const float w = p[i * kKeyChunk + j + u];
        for (int c = 0; c < DV; ++c) a[u][i][c] += w * vv[c];
      }
    }
  }
  for (; j < n; ++j) {
    pf.part(j, j + 1, n);
    for (int c = 0; c < DV; ++c) {
      const vfloat vv = load_v(v + j * D + d0 + c * kVec);
      for (int i = 0; i < RB; ++i) a[0][i][c] += p[i * kKeyChunk + j] * vv;
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < DV; ++c) {
      vfloat sum = a[0][i][c];
      for (int u = 1; u < U; ++u) sum += a[u][i][c];
      store_v(acc + i * D + d0 + c * kVec, sum);
    }
}

template <int RB, typename S>
static inline void pv_rows(float* acc, const float* p, const float* alpha, const S* v,
                           int64_t n, int64_t D, const ChunkPrefetch& pf) {
  const ChunkPrefetch none;
  int64_t d0 = 0;
  constexpr int U = RB <= 3 ? 2 : 1;  // 4 rows already give 8 chains; two sets would spill
  for (; d0 + 2 * kVec <= D; d0 += 2 * kVec) pv_block<RB, 2, U>(acc, p, alpha, v, n, D, d0, d0 == 0 ? pf : none);
  if (d0 < D) pv_block<RB, 1, U>(acc, p, alpha, v, n, D, d0, d0 == 0 ? pf : none);
}

// P.V of rb <= kMaxRowBlock rows in one register block (each V row is read once per block).
template <typename S>
static inline void pv_any(float* acc, const float* p, const float* alpha, const S* v, int64_t n,
                          int64_t D, int64_t rb, const ChunkPrefetch& pf) {
  switch (rb) {
    case 4: pv_rows<4>(acc, p, alpha, v, n, D, pf); break;
    case 3: pv_rows<3>(acc, p, alpha, v, n, D, pf); break;
    case 2: pv_rows<2>(acc, p, alpha, v, n, D, pf); break;
    default: pv_rows<1>(acc, p, alpha, v, n, D, pf); break;
  }
}
static_assert(kMaxRowBlock == 4, "pv_any dispatches 1..4 rows");

typedef int32_t vint __attribute__((vector_size(kVec * sizeof(int32_t))));

// fast_exp on a whole vector (the attention kernels hold scores in vfloat registers).
static inline vfloat fast_exp_v(vfloat x) {
  const vfloat lo = vfloat{} - 87.f, hi = vfloat{} + 88.f;
  vfloat xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  vfloat shifted;
  const vfloat poly = exp_reduced(xc, shifted);
  vint bits;
  __builtin_memcpy(&bits, &shifted, sizeof bits);
  bits = (bits - 0x4B400000 + 127) << 23;
  vfloat two_n;
  __builtin_memcpy(&two_n, &bits, sizeof two_n);
  return x < lo ? vfloat{} : poly * two_n;
}

// Online-softmax step of row i over its n scores: masks keys past the row's limit, turns the
// scores into probabilities against the new running max and returns the factor that rescales
// the row's earlier acc and l (1 when the row sees none of these keys: all p are then 0).
static inline float softmax_step(Rows& r, int64_t i, int64_t t0, int64_t n) {
  float* s = r.s + i * kKeyChunk;
  const int64_t visible = min_i(n, r.limit[i] - t0 + 1);  // keys j < visible are unmasked
  // ... and keys j >= first, with a sliding window
  const int64_t first = r.window > 0 ? max_i(0, r.limit[i] - r.window + 1 - t0) : 0;
  const int64_t padded = (n + kVec - 1) / kVec * kVec;     // <= kKeyChunk
  if (visible <= first) {
    for (int64_t j = 0; j < n; ++j) s[j] = 0.f;
    return 1.f;
  }
  for (int64_t j = 0; j < first; ++j) s[j] = -__builtin_inff();
  for (int64_t j = visible; j < padded; ++j) s[j] = -__builtin_inff();
  vfloat vmax = load_v(s);
  for (int64_t j = kVec; j < padded; j += kVec) {
    const vfloat x = load_v(s + j);
    vmax = x > vmax ? x : vmax;
  }
  const float m_new = max_f(r.m[i], hmax(vmax));
  const float alpha = fast_exp(r.m[i] - m_new);  // 0 for the first keys (m = -inf)
  vfloat vsum = vfloat{};
  for (int64_t j = 0; j < padded; j += kVec) {
    const vfloat e = fast_exp_v(load_v(s + j) - m_new);
    store_v(s + j, e);
    vsum += e;
  }
  r.l[i] = r.l[i] * alpha + hsum(vsum);
  r.m[i] = m_new;
  return alpha;
}

// Rows r take the n keys from position t0 (K and V rows of stride D) in row blocks of
// kMaxRowBlock: scores, online softmax, then P.V into acc.
template <typename S>
static inline void attend_chunk(Rows& r, const S* k, const S* v, int64_t t0, int64_t n, int64_t D, float* alpha,
                                const ChunkPrefetch& pf_k, const ChunkPrefetch& pf_v) {
  const ChunkPrefetch none;
  for (int64_t i0 = 0; i0 < r.n; i0 += kMaxRowBlock) {
    const int64_t rb = min_i(kMaxRowBlock, r.n - i0);
    // NOTE: limits never decrease along the rows (token-major rows), so the last is the max.
    if (r.limit[i0 + rb - 1] < t0) continue;  // none of these rows sees a key
    if (r.window > 0 && r.limit[i0] - r.window + 1 >= t0 + n) continue;  // all before the rows' windows
    float* s = r.s + i0 * kKeyChunk;
    score_any(r.q + i0 * D, k, n, D, s, rb, i0 == 0 ? pf_k : none);
    for (int64_t i = 0; i < rb; ++i) alpha[i] = softmax_step(r, i0 + i, t0, n);
    pv_any(r.acc + i0 * D, s, alpha, v, n, D, rb, i0 == 0 ? pf_v : none);
  }
}

// Rows r attend to cached keys [k_begin, k_end) of the sequence whose block table row is
// block_row, through KV head kv_head; key t is masked for row i when t > r.limit[i]. T: the
// cache's element type (p.kv_dtype).
template <typename T>
void attend(const PagedAttentionParams& p, const int32_t* block_row, int64_t kv_head,
            int64_t k_begin, int64_t k_end, Rows& r) {
  const int64_t D = p.head_dim, bs = p.block_size;
  const int64_t head_elems = bs * D;  // one KV head of one block
  const T* cache = static_cast<const T*>(p.kv_cache);
  float alpha[kMaxRowBlock];
  for (int64_t t0 = k_begin; t0 < k_end;) {
    const int64_t off = t0 % bs;
    const int64_t n = min_i(kKeyChunk, min_i(bs - off, k_end - t0));
    const T* k = cache + (int64_t(block_row[t0 / bs]) * 2 * p.n_kv_heads + kv_head) * head_elems + off * D;
    const T* v = k + p.n_kv_heads * head_elems;
    // The next chunk's block is anywhere in the cache, out of the hardware prefetcher's reach:
    // its K and V are prefetched while this chunk's scores and P.V run.
    ChunkPrefetch pf_k, pf_v;
    if (t0 + n < k_end) {
      const int64_t t1 = t0 + n, off1 = t1 % bs;
      const int64_t n1 = min_i(kKeyChunk, min_i(bs - off1, k_end - t1));
      pf_k.p = reinterpret_cast<const char*>(
          cache + (int64_t(block_row[t1 / bs]) * 2 * p.n_kv_heads + kv_head) * head_elems + off1 * D);
      pf_v.p = pf_k.p + p.n_kv_heads * head_elems * int64_t(sizeof(T));
      pf_k.bytes = pf_v.bytes = n1 * D * int64_t(sizeof(T));
    }
    // Few rows (decode): K/V straight from the cache, widened in registers (AVX2 and up; the
    // SSE2 build has no cheap widening). Many: one fp32 copy for all row blocks.
    if (kVec >= 8 && r.n <= kMaxRowBlock) {
      attend_chunk(r, k, v, t0, n, D, alpha, pf_k, pf_v);
    } else {
      attend_chunk(r, as_f32(k, n * D, r.kbuf), as_f32(v, n * D, r.vbuf), t0, n, D, alpha, pf_k, pf_v);
    }
    t0 += n;
  }
}

// out_row = acc_i / l_i, rounded to T.
template <typename T>
static inline void store_row(const Rows& r, int64_t i, T* out, int64_t head_dim) {
  const float inv_l = 1.f / r.l[i];
  const float* acc = r.acc + i * head_dim;
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) out[d] = from_f32<T>(acc[d] * inv_l);
}

}  // namespace attn

// Split-context attention (attention_decode.cpp) over the sequences seqs[0 .. n_seqs): for
// decode, and for prefill sequences with few query tokens and a long context.
void paged_attention_split(const PagedAttentionParams& p, const int64_t* seqs, int64_t n_seqs);

}  // namespace kog::cpu::KOG_ISA_NS
