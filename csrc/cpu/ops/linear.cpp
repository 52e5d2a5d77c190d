// CPU linear for decode batches. Contract: csrc/ops/linear.h.
// Tiling: kRows weight rows x kCols input rows of fp32 accumulators; each weight element is
// loaded once per kCols inputs, each x element once per kRows weights. x is converted to fp32
// once up front ([m, k] scratch), so the inner loop converts only the weight stream.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "cpu/kernels.h"
#include "cpu/vec.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

constexpr int kRows = 4;
constexpr int kCols = 2;
// Below this many weight elements a linear runs on the calling thread.
constexpr int64_t kLinearParallelMin = 1 << 16;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vec_t = __m512;
static inline vec_t vzero() { return _mm512_setzero_ps(); }
static inline vec_t vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec_t vload(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vec_t vload(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec_t v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kLanes = 8;
using vec_t = __m256;
static inline vec_t vzero() { return _mm256_setzero_ps(); }
static inline vec_t vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec_t vload(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vec_t vload(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec_t v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#define KOG_LINEAR_SCALAR 1
#endif

#ifndef KOG_LINEAR_SCALAR
// acc[r][c] = dot(w[r], x[c]) for the rows/cols present (nr <= kRows, nc <= kCols).
template <typename T>
void tile_dot(const T* const* w, const float* const* x, int nr, int nc, int64_t k,
              float acc[kRows][kCols]) {
  vec_t a[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) a[r][c] = vzero();
  int64_t i = 0;
  const int64_t kv = k - k % kLanes;
  if (nr == kRows && nc == kCols) {  // the hot path: full tile, fixed trip counts
    for (; i < kv; i += kLanes) {
      const vec_t x0 = vload(x[0] + i), x1 = vload(x[1] + i);
      for (int r = 0; r < kRows; ++r) {
        const vec_t wv = vload(w[r] + i);
        a[r][0] = vfma(wv, x0, a[r][0]);
        a[r][1] = vfma(wv, x1, a[r][1]);
      }
    }
  } else if (nr == kRows && nc == 1) {  // batch 1 (and odd batches' last row): fixed trip counts too
    for (; i < kv; i += kLanes) {
      const vec_t x0 = vload(x[0] + i);
      for (int r = 0; r < kRows; ++r) a[r][0] = vfma(vload(w[r] + i), x0, a[r][0]);
    }
  } else {
    for (; i < kv; i += kLanes) {
      for (int r = 0; r < nr; ++r) {
        const vec_t wv = vload(w[r] + i);
        for (int c = 0; c < nc; ++c) a[r][c] = vfma(wv, vload(x[c] + i), a[r][c]);
      }
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < nc; ++c) {
      float s = vsum(a[r][c]);
      for (int64_t j = kv; j < k; ++j) s += to_f32(w[r][j]) * x[c][j];
      acc[r][c] = s;
    }
}
#else
template <typename T>
void tile_dot(const T* const* w, const float* const* x, int nr, int nc, int64_t k,
              float acc[kRows][kCols]) {
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < nc; ++c) {
      float s = 0.f;
      const T* wr = w[r];
      const float* xc = x[c];
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < k; ++j) s += to_f32(wr[j]) * xc[j];
      acc[r][c] = s;
    }
}
#endif

// Output tiles [tile_begin, tile_end) of kRows rows each; xf is x converted to f32 ([m, k]).
template <typename T>
void linear_tiles(const LinearParams& p, const float* xf, int64_t tile_begin, int64_t tile_end) {
  const int64_t m = p.m, n = p.n, k = p.k;
  const T* weight = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t r0 = t * kRows;
    const int nr = int(n - r0 < kRows ? n - r0 : kRows);
    const T* w[kRows];
    for (int r = 0; r < kRows; ++r) w[r] = weight + (r0 + (r < nr ? r : 0)) * k;
    for (int64_t c0 = 0; c0 < m; c0 += kCols) {
      const int nc = int(m - c0 < kCols ? m - c0 : kCols);
      const float* x[kCols];
      for (int c = 0; c < kCols; ++c) x[c] = xf + (c0 + (c < nc ? c : 0)) * k;
      float acc[kRows][kCols];
      tile_dot<T>(w, x, nr, nc, k, acc);
      for (int r = 0; r < nr; ++r) {
        const float b = bias != nullptr ? to_f32(bias[r0 + r]) : 0.f;
        for (int c = 0; c < nc; ++c) out[(c0 + c) * p.out_stride + r0 + r] = from_f32<T>(acc[r][c] + b);
      }
    }
  }
}

template <typename T>
void convert_x(const LinearParams& p, float* xf) {
  for (int64_t c = 0; c < p.m; ++c) {
    const T* xr = static_cast<const T*>(p.x) + c * p.x_stride;
    for (int64_t j = 0; j < p.k; ++j) xf[c * p.k + j] = to_f32(xr[j]);
  }
}

// Part `part` of `n_parts` (contiguous, balanced ranges of output tiles).
template <typename T>
void linear_part_typed(const LinearParams& p, float* xf, int part, int n_parts) {
  convert_x<T>(p, xf);
  const int64_t n_tiles = (p.n + kRows - 1) / kRows;
  linear_tiles<T>(p, xf, n_tiles * part / n_parts, n_tiles * (part + 1) / n_parts);
}

template <typename T>
void linear_typed(const LinearParams& p, float* xf) {
  convert_x<T>(p, xf);
  const int64_t n_tiles = (p.n + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (p.n * p.k >= kLinearParallelMin)
  for (int64_t t = 0; t < n_tiles; ++t) linear_tiles<T>(p, xf, t, t + 1);
}

}  // namespace

// scratch: at least m * k floats.
void linear(const LinearParams& p, float* scratch) {
  dispatch_float(p.dtype, [&](auto tag) { linear_typed<decltype(tag)>(p, scratch); });
}

// Called by each thread of a parallel region the caller owns; scratch is the thread's own.
void linear_part(const LinearParams& p, float* scratch, int part, int n_parts) {
  dispatch_float(p.dtype, [&](auto tag) { linear_part_typed<decltype(tag)>(p, scratch, part, n_parts); });
}

}  // namespace kog::cpu::KOG_ISA_NS
