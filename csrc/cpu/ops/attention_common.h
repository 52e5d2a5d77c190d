// Shared core of the CPU paged-attention kernels (attention_decode.cpp, attention_prefill.cpp):
// a block of query rows that read one KV head attends to a range of cached keys with online
// softmax in fp32. Included only by per-ISA kernel sources: everything is ISA-local.
#pragma once
#include "cpu/kernels.h"
#include "cpu/vec.h"

namespace kog::cpu::KOG_ISA_NS {
namespace attn {

// head_dim is a multiple of kLanes: the inner loops have this fixed width, which the compiler
// turns into whole vector registers (2 x AVX2, 1 x AVX-512) kept across the outer loop.
constexpr int kLanes = 16;
constexpr int64_t kMaxHeadDim = 256;
// Keys scored together: one chunk never crosses a KV block.
constexpr int64_t kKeyChunk = 32;

// exp(x) to ~2 ulp, written so that loops over it vectorize (libm's expf does not):
// exp(x) = 2^n exp(r), n = round(x / ln2), |r| <= ln2/2, exp(r) by its degree-6 Taylor
// polynomial. Returns 0 below -87 (incl. -inf, the masked scores).
static inline float fast_exp(float x) {
  const float xc = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float shifted = xc * 1.44269504f + 12582912.f;  // + 1.5 * 2^23 rounds to an integer
  const float n = shifted - 12582912.f;
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split in two: exact n * hi
  float poly = 1.f / 720.f;
  poly = poly * r + 1.f / 120.f;
  poly = poly * r + 1.f / 24.f;
  poly = poly * r + 1.f / 6.f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.f;
  poly = poly * r + 1.f;
  const int32_t ni = int32_t(f32_to_bits(shifted)) - 0x4B400000;  // n as an integer
  const float two_n = bits_to_f32(uint32_t(ni + 127) << 23);
  return x < -87.f ? 0.f : poly * two_n;
}

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

// Floats of scratch a Rows of max_rows rows needs (Rows::bind carves them).
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

static inline float dot(const float* a, const float* b, int64_t head_dim) {
  float part[kLanes] = {};
  for (int64_t d = 0; d < head_dim; d += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) part[j] += a[d + j] * b[d + j];
  }
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += part[j];
  return s;
}

// Online-softmax step of row i over the n scores in s: rescales acc and l to the new max and
// turns s into probabilities. Returns false when the row sees none of these keys.
static inline bool softmax_step(Rows& r, int64_t i, int64_t n, int64_t head_dim) {
  float* s = r.s + i * kKeyChunk;
  float mx = -__builtin_inff();
  for (int64_t j = 0; j < n; ++j) mx = max_f(mx, s[j]);
  if (mx == -__builtin_inff()) return false;
  const float m_new = max_f(r.m[i], mx);
  const float alpha = fast_exp(r.m[i] - m_new);  // 0 for the first keys (m = -inf)
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = fast_exp(s[j] - m_new);
    s[j] = e;
    sum += e;
  }
  r.l[i] = r.l[i] * alpha + sum;
  r.m[i] = m_new;
  if (alpha != 1.f) {
    float* acc = r.acc + i * head_dim;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= alpha;
  }
  return true;
}

// acc_i += sum_j p_ij v_j, kLanes columns at a time so the partial sums stay in registers.
static inline void accumulate_v(float* acc, const float* p, const float* v, int64_t n, int64_t head_dim) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += kLanes) {
    float a[kLanes];
    for (int j = 0; j < kLanes; ++j) a[j] = acc[d0 + j];
    for (int64_t t = 0; t < n; ++t) {
      const float w = p[t];
      const float* vr = v + t * head_dim + d0;
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) a[j] += w * vr[j];
    }
    for (int j = 0; j < kLanes; ++j) acc[d0 + j] = a[j];
  }
}

// Rows r attend to cached keys [k_begin, k_end) of the sequence whose block table row is
// block_row, through KV head kv_head; key t is masked for row i when t > r.limit[i].
template <typename T>
void attend(const PagedAttentionParams& p, const int32_t* block_row, int64_t kv_head,
            int64_t k_begin, int64_t k_end, Rows& r) {
  const int64_t D = p.head_dim, bs = p.block_size;
  const int64_t head_elems = bs * D;  // one KV head of one block
  const T* cache = static_cast<const T*>(p.kv_cache);
  for (int64_t t0 = k_begin; t0 < k_end;) {
    const int64_t off = t0 % bs;
    const int64_t n = min_i(kKeyChunk, min_i(bs - off, k_end - t0));
    const T* k = cache + (int64_t(block_row[t0 / bs]) * 2 * p.n_kv_heads + kv_head) * head_elems + off * D;
    const T* v = k + p.n_kv_heads * head_elems;
    const float* kf = as_f32(k, n * D, r.kbuf);
    bool any = false;
    for (int64_t i = 0; i < r.n; ++i) {
      const float* qi = r.q + i * D;
      float* s = r.s + i * kKeyChunk;
      const int64_t visible = r.limit[i] - t0 + 1;  // keys j < visible are not masked
      for (int64_t j = 0; j < n; ++j) s[j] = j < visible ? dot(qi, kf + j * D, D) : -__builtin_inff();
      any |= visible > 0;
    }
    if (any) {
      const float* vf = as_f32(v, n * D, r.vbuf);
      for (int64_t i = 0; i < r.n; ++i)
        if (softmax_step(r, i, n, D)) accumulate_v(r.acc + i * D, r.s + i * kKeyChunk, vf, n, D);
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
}  // namespace kog::cpu::KOG_ISA_NS
