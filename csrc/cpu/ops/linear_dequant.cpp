// The quantized linear with x kept in f32 (LinearQuantParams::x_stages == 0), for prefill-sized m:
// each work item dequantizes kTileRows weight rows into a thread-local f32 tile (it stays in L2)
// and multiplies it with every row of x in register blocks of kR weight rows x kC rows of x.
// Products are exact f32: the result is the dequantized f32 matrix's, up to summation order,
// with one dequantization of each row per call shared by all m rows of x, in Kog's own pool
// (no f32 copy of the matrix in memory, no hand-over to torch's threads between ops).
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/ops/quant_dot.h"
#include "cpu/vec.h"

namespace kog::cpu::KOG_ISA_NS {

// csrc/cpu/ops/dequantize.cpp
void dequantize_row(QuantType type, const uint8_t* w, int64_t k, float* y);
// Row r of a [*, k] matrix of `type` in its file layout: the row itself, or, for a packed type, its
// blocks gathered from their group into buf (row_bytes).
const uint8_t* plain_row(QuantType type, const uint8_t* w, int64_t r, int64_t row_bytes, uint8_t* buf);

namespace {

constexpr int64_t kTileRows = 16;
constexpr int kC = 4;  // rows of x per register block
// Below this many multiply-adds a call runs on the calling thread.
constexpr int64_t kParallelMinMacs = 1 << 18;

#if defined(__AVX512F__)
constexpr int kLanes = 16, kR = 4;  // 16 accumulators + 4 weight vectors + x of 32 registers
using vec_t = __m512;
static inline vec_t vzero() { return _mm512_setzero_ps(); }
static inline vec_t vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8, kR = 3;  // 12 accumulators + 3 weight vectors + x: the 16 registers
using vec_t = __m256;
static inline vec_t vzero() { return _mm256_setzero_ps(); }
static inline vec_t vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm256_fmadd_ps(a, b, c); }
#else
#define KOG_DEQUANT_SCALAR 1
constexpr int kR = 4;
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 bytes -> 8 floats: y = d * q + off (q unsigned) or d * q (signed).
static inline void put8(float* y, __m128i q8, __m256 d, __m256 off, bool is_signed) {
  const __m256i q = is_signed ? _mm256_cvtepi8_epi32(q8) : _mm256_cvtepu8_epi32(q8);
  *reinterpret_cast<__m256_u*>(y) = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), off);
}

// The 32-element block formats vectorized (the scalar dequantize_row is ~4 G elements/s, which
// a short prefill would spend most of its time in); false for the K-quants.
bool dequantize_row_fast(QuantType type, const uint8_t* row, int64_t k, float* y) {
  const __m128i low4 = _mm_set1_epi8(15);
  const __m256 zero = _mm256_setzero_ps();
  const int64_t nb = k / kQuantBlock;
  if (type == QuantType::kQ8_0) {
    const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row);
    for (int64_t i = 0; i < nb; ++i, y += kQuantBlock) {
      const __m256 d = _mm256_set1_ps(half_to_f32(b[i].d));
      for (int j = 0; j < 4; ++j)
        put8(y + 8 * j, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b[i].qs + 8 * j)), d, zero, true);
    }
    return true;
  }
  if (type != QuantType::kQ4_0 && type != QuantType::kQ4_1) return false;
  const bool q4_1 = type == QuantType::kQ4_1;
  const int64_t block_bytes = q4_1 ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0);
  for (int64_t i = 0; i < nb; ++i, y += kQuantBlock, row += block_bytes) {
    const uint8_t* qs = q4_1 ? reinterpret_cast<const BlockQ4_1*>(row)->qs : reinterpret_cast<const BlockQ4_0*>(row)->qs;
    const __m256 d = _mm256_set1_ps(half_to_f32(reinterpret_cast<const BlockQ4_0*>(row)->d));
    const __m256 off = q4_1 ? _mm256_set1_ps(half_to_f32(reinterpret_cast<const BlockQ4_1*>(row)->m)) : zero;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    if (!q4_1) {  // q - 8 in the integers, as the reference computes d * (q - 8)
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    put8(y, lo, d, off, !q4_1);
    put8(y + 8, _mm_srli_si128(lo, 8), d, off, !q4_1);
    put8(y + 16, hi, d, off, !q4_1);
    put8(y + 24, _mm_srli_si128(hi, 8), d, off, !q4_1);
  }
  return true;
}
#else
bool dequantize_row_fast(QuantType, const uint8_t*, int64_t, float*) { return false; }
#endif

// out[c, r] = dot(w row r, x row c) + bias[r] for r < R, c < C; k is a multiple of 32 (a block).
template <int R, int C>
void block(const float* w, int64_t k, const float* x, int64_t x_stride, float* out, int64_t out_stride,
           const float* bias) {
#ifdef KOG_DEQUANT_SCALAR
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = 0.f;
      const float *wr = w + r * k, *xc = x + c * x_stride;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < k; ++i) s += wr[i] * xc[i];
      out[c * out_stride + r] = s + (bias ? bias[r] : 0.f);
    }
#else
  vec_t acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  for (int64_t i = 0; i < k; i += kLanes) {
    vec_t wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vload(w + r * k + i);
    for (int c = 0; c < C; ++c) {
      const vec_t xv = vload(x + c * x_stride + i);
      for (int r = 0; r < R; ++r) acc[r][c] = vfma(wv[r], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[c * out_stride + r] = reduce_add(acc[r][c]) + (bias ? bias[r] : 0.f);
#endif
}

template <int R>
void block_c(int nc, const float* w, int64_t k, const float* x, int64_t x_stride, float* out, int64_t out_stride,
             const float* bias) {
  switch (nc) {
    case 1: block<R, 1>(w, k, x, x_stride, out, out_stride, bias); break;
    case 2: block<R, 2>(w, k, x, x_stride, out, out_stride, bias); break;
    case 3: block<R, 3>(w, k, x, x_stride, out, out_stride, bias); break;
    default: block<R, kC>(w, k, x, x_stride, out, out_stride, bias); break;
  }
}

void block_rc(int nr, int nc, const float* w, int64_t k, const float* x, int64_t x_stride, float* out,
              int64_t out_stride, const float* bias) {
  switch (nr) {
    case 1: block_c<1>(nc, w, k, x, x_stride, out, out_stride, bias); break;
    case 2: block_c<2>(nc, w, k, x, x_stride, out, out_stride, bias); break;
    case 3: block_c<3>(nc, w, k, x, x_stride, out, out_stride, bias); break;
    default: block_c<kR>(nc, w, k, x, x_stride, out, out_stride, bias); break;
  }
}

// Output columns [r0, r0 + nr) of every row of x, through the thread's f32 tile.
void tile_rows(const LinearQuantParams& p, int64_t row_bytes, int64_t r0, int64_t nr) {
  thread_local std::vector<float> tile;
  thread_local std::vector<uint8_t> row_buf;
  tile.resize(static_cast<size_t>(kTileRows * p.k));
  row_buf.resize(static_cast<size_t>(row_bytes));
  const QuantType base = packed_base(p.type);
  for (int64_t r = 0; r < nr; ++r) {
    const uint8_t* w = plain_row(p.type, p.weight, r0 + r, row_bytes, row_buf.data());
    if (!dequantize_row_fast(base, w, p.k, &tile[r * p.k])) dequantize_row(base, w, p.k, &tile[r * p.k]);
  }
  const float* x = static_cast<const float*>(p.x);
  for (int64_t c0 = 0; c0 < p.m; c0 += kC) {
    const int nc = int(std::min<int64_t>(kC, p.m - c0));
    for (int64_t r = 0; r < nr; r += kR) {
      const int n_r = int(std::min<int64_t>(kR, nr - r));
      block_rc(n_r, nc, &tile[r * p.k], p.k, x + c0 * p.x_stride, p.x_stride, p.out + c0 * p.out_stride + r0 + r,
               p.out_stride, p.bias ? p.bias + r0 + r : nullptr);
    }
  }
}

}  // namespace

// x: f32 (the binding checks it); out = x @ dequantize(W)^T (+ bias).
void linear_dequant(const LinearQuantParams& p, int64_t row_bytes) {
  const int64_t n_tiles = (p.n + kTileRows - 1) / kTileRows;
  parallel_for(n_tiles, p.m * p.n * p.k >= kParallelMinMacs, [&](int64_t t) {
    tile_rows(p, row_bytes, t * kTileRows, std::min(kTileRows, p.n - t * kTileRows));
  });
}

}  // namespace kog::cpu::KOG_ISA_NS
