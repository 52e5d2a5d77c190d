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

static inline const float* as_f32(const float* src, int64_t, float*) { return src; }
template <typename T>
static inline const float* as_f32(const T* src, int64_t n, float* buf) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = to_f32(src[i]);
  return buf;
}

// Register-blocked micro-kernels on GCC vector types: one source, the vector width of each ISA
// build (4 lanes generic SSE2, 8 AVX2, 16 AVX-512). Blocks are sized to fit 16 registers.
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
static inline void store_v(float* p, vfloat v) { __builtin_memcpy(p, &v, sizeof v); }
static inline float hsum(vfloat v) {
  float s = 0.f;
  for (int l = 0; l < kVec; ++l) s += v[l];
  return s;
}

// s[i][j] = q_i . k_j for RB query rows and KB keys (both with row stride D); s row stride kKeyChunk.
template <int RB, int KB>
static inline void score_block(const float* q, const float* k, int64_t D, float* s) {
  vfloat acc[RB][KB];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < KB; ++j) acc[i][j] = vfloat{};
  for (int64_t d = 0; d < D; d += kVec) {
    vfloat kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = load_v(k + j * D + d);
    for (int i = 0; i < RB; ++i) {
      const vfloat qv = load_v(q + i * D + d);
      for (int j = 0; j < KB; ++j) acc[i][j] += qv * kv[j];
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < KB; ++j) s[i * kKeyChunk + j] = hsum(acc[i][j]);
}

template <int RB>
static inline void score_rows(const float* q, const float* k, int64_t n, int64_t D, float* s) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) score_block<RB, 4>(q, k + j * D, D, s + j);
  for (; j < n; ++j) score_block<RB, 1>(q, k + j * D, D, s + j);
}

// acc_i = alpha_i acc_i + sum_j p_ij v_j on DV vectors of columns from d0, for RB rows.
template <int RB, int DV>
static inline void pv_block(float* acc, const float* p, const float* alpha, const float* v,
                            int64_t n, int64_t D, int64_t d0) {
  vfloat a[RB][DV];
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < DV; ++c) a[i][c] = load_v(acc + i * D + d0 + c * kVec) * alpha[i];
  for (int64_t j = 0; j < n; ++j) {
    vfloat vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = load_v(v + j * D + d0 + c * kVec);
    for (int i = 0; i < RB; ++i) {
      const float w = p[i * kKeyChunk + j];
      for (int c = 0; c < DV; ++c) a[i][c] += w * vv[c];
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int c = 0; c < DV; ++c) store_v(acc + i * D + d0 + c * kVec, a[i][c]);
}

template <int RB>
static inline void pv_rows(float* acc, const float* p, const float* alpha, const float* v,
                           int64_t n, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 2 * kVec <= D; d0 += 2 * kVec) pv_block<RB, 2>(acc, p, alpha, v, n, D, d0);
  if (d0 < D) pv_block<RB, 1>(acc, p, alpha, v, n, D, d0);
}

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
  const int64_t padded = (n + kVec - 1) / kVec * kVec;     // <= kKeyChunk
  if (visible <= 0) {
    for (int64_t j = 0; j < n; ++j) s[j] = 0.f;
    return 1.f;
  }
  for (int64_t j = visible; j < padded; ++j) s[j] = -__builtin_inff();
  vfloat vmax = load_v(s);
  for (int64_t j = kVec; j < padded; j += kVec) {
    const vfloat x = load_v(s + j);
    vmax = x > vmax ? x : vmax;
  }
  float mx = vmax[0];
  for (int l = 1; l < kVec; ++l) mx = max_f(mx, vmax[l]);
  const float m_new = max_f(r.m[i], mx);
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

// Rows r attend to cached keys [k_begin, k_end) of the sequence whose block table row is
// block_row, through KV head kv_head; key t is masked for row i when t > r.limit[i].
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
    if (t0 + n < k_end) {
      // The next chunk's block is anywhere in the cache, out of the hardware prefetcher's reach.
      const int64_t t1 = t0 + n, off1 = t1 % bs;
      const int64_t n1 = min_i(kKeyChunk, min_i(bs - off1, k_end - t1));
      const char* k1 = reinterpret_cast<const char*>(
          cache + (int64_t(block_row[t1 / bs]) * 2 * p.n_kv_heads + kv_head) * head_elems + off1 * D);
      const char* v1 = k1 + p.n_kv_heads * head_elems * int64_t(sizeof(T));
      for (int64_t b = 0; b < n1 * D * int64_t(sizeof(T)); b += 64) {
        __builtin_prefetch(k1 + b);
        __builtin_prefetch(v1 + b);
      }
    }
    const float* kf = as_f32(k, n * D, r.kbuf);
    const float* vf = as_f32(v, n * D, r.vbuf);
    for (int64_t i0 = 0; i0 < r.n; i0 += kMaxRowBlock) {
      const int64_t rb = min_i(kMaxRowBlock, r.n - i0);
      // NOTE: limits never decrease along the rows (token-major rows), so the last is the max.
      if (r.limit[i0 + rb - 1] < t0) continue;  // none of these rows sees a key
      const float* q = r.q + i0 * D;
      float* s = r.s + i0 * kKeyChunk;
      float* acc = r.acc + i0 * D;
      int64_t i = 0;
      for (; i + 2 <= rb; i += 2) score_rows<2>(q + i * D, kf, n, D, s + i * kKeyChunk);
      if (i < rb) score_rows<1>(q + i * D, kf, n, D, s + i * kKeyChunk);
      for (i = 0; i < rb; ++i) alpha[i] = softmax_step(r, i0 + i, t0, n);
      if (rb == kMaxRowBlock) {
        pv_rows<kMaxRowBlock>(acc, s, alpha, vf, n, D);
      } else {
        for (i = 0; i < rb; ++i) pv_rows<1>(acc + i * D, s + i * kKeyChunk, alpha + i, vf, n, D);
      }
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
