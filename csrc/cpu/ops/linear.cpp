// CPU linear for decode batches. Contract: csrc/ops/linear.h.
// Tiling: ONE weight row at a time against up to kCols input rows, so each thread reads its
// share of the weight matrix as a single sequential stream (several rows in flight at once
// are several streams, which this class of CPU prefetches far worse: bench/cpu_linear.py).
// Each weight element is loaded once per kCols inputs; extra inputs re-read the row from L1.
// x is converted to fp32 once up front ([m, k] scratch), so the loop converts only weights.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>

#include "cpu/kernels.h"
#include "cpu/vec.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

constexpr int kCols = 4;
// Below this many weight elements a linear runs on the calling thread.
constexpr int64_t kLinearParallelMin = 1 << 16;

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vec_t = __m512;
static inline vec_t vzero() { return _mm512_setzero_ps(); }
static inline vec_t vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec_t vload(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 2 x kLanes bf16 -> two fp32 vectors by interleaving with zeros inside each 128-bit lane (the
// bf16 bits land in the high half, which is the fp32 value): one uop per vector, no lane crossing.
// The elements come out in pair order (see pair_index).
static inline void vload2(const bf16_t* p, vec_t& lo, vec_t& hi) {
  const __m512i h = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
  lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, h));
  hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, h));
}
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec_t vadd(vec_t a, vec_t b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kLanes = 8;
using vec_t = __m256;
static inline vec_t vzero() { return _mm256_setzero_ps(); }
static inline vec_t vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec_t vload(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline void vload2(const bf16_t* p, vec_t& lo, vec_t& hi) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
}
static inline vec_t vfma(vec_t a, vec_t b, vec_t c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec_t vadd(vec_t a, vec_t b) { return _mm256_add_ps(a, b); }
#else
#define KOG_LINEAR_SCALAR 1
#endif

#ifndef KOG_LINEAR_SCALAR
// Pair order of a group of kPair = 2 x kLanes elements: vload2 yields, per 128-bit lane L, the
// group's elements 8L..8L+3 in `lo` and 8L+4..8L+7 in `hi`. So x for bf16 weights is stored
// permuted: position j of a group holds element pair_index(j). Groups cover k / kPair * kPair
// elements; the tail stays in natural order.
constexpr int kPair = 2 * kLanes;
static inline int pair_index(int j) {
  const int half = j / kLanes, lane = (j % kLanes) / 4, e = j % 4;
  return 8 * lane + 4 * half + e;
}

// The bf16 row loop may ask for the weights kPrefetchBytes ahead of the current load (the rows of
// a thread's share are contiguous, so this runs on into the next rows), as weight_prefetch()
// says (cpu/kernels.h; by CPU vendor, dispatch.cpp). Measured on a 2-core Zen3 VM
// (docs/PERFORMANCE.md): +9% decode tok/s non-temporal at 768-1024 bytes, less beyond 1.5 KB; on
// a 2-core Xeon VM non-temporal halved bf16 decode and T0 was best. The fp32 loop gained nothing,
// so it does not prefetch.
constexpr int kPrefetchBytes = 1024;
template <WeightPrefetch kMode>
static inline void prefetch_weights(const void* p) {
  if constexpr (kMode == WeightPrefetch::kNta)
    _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_NTA);
  else if constexpr (kMode == WeightPrefetch::kT0)
    _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

template <int NC, WeightPrefetch kMode>
void row_dot_bf16_pairs(const bf16_t* w, const float* const* x, int64_t k, float* acc) {
  constexpr int kChains = NC == 1 ? 2 : 1;  // x 2 vectors per load
  constexpr int64_t kStep = int64_t(kChains) * kPair;
  vec_t a[NC][2 * kChains];
  for (int c = 0; c < NC; ++c)
    for (int u = 0; u < 2 * kChains; ++u) a[c][u] = vzero();
  int64_t i = 0;
  for (; i + kStep <= k; i += kStep) {
    // One prefetch per 64-byte line (per step when a step is shorter than a line).
    if constexpr (kMode != WeightPrefetch::kNone)
      for (int64_t b = 0; b < kStep; b += 64 / int64_t(sizeof(bf16_t))) prefetch_weights<kMode>(w + i + b);
    for (int u = 0; u < kChains; ++u) {
      vec_t lo, hi;
      vload2(w + i + u * kPair, lo, hi);
      for (int c = 0; c < NC; ++c) {
        a[c][2 * u] = vfma(lo, vload(x[c] + i + u * kPair), a[c][2 * u]);
        a[c][2 * u + 1] = vfma(hi, vload(x[c] + i + u * kPair + kLanes), a[c][2 * u + 1]);
      }
    }
  }
  for (; i + kPair <= k; i += kPair) {
    vec_t lo, hi;
    vload2(w + i, lo, hi);
    for (int c = 0; c < NC; ++c) {
      a[c][0] = vfma(lo, vload(x[c] + i), a[c][0]);
      a[c][1] = vfma(hi, vload(x[c] + i + kLanes), a[c][1]);
    }
  }
  for (int c = 0; c < NC; ++c) {
    for (int u = 1; u < 2 * kChains; ++u) a[c][0] = vadd(a[c][0], a[c][u]);
    float s = reduce_add(a[c][0]);
    for (int64_t j = i; j < k; ++j) s += to_f32(w[j]) * x[c][j];  // tail: natural order
    acc[c] = s;
  }
}

// acc[c] = dot(w, x[c]) for c < NC. kChains independent accumulators per input hide the FMA
// latency: 4 for one input, 2 each for more (2 x 4 registers at most).
template <int NC, typename T>
void row_dot(const T* w, const float* const* x, int64_t k, float* acc) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    switch (weight_prefetch()) {  // a relaxed load per row
      case WeightPrefetch::kNta: row_dot_bf16_pairs<NC, WeightPrefetch::kNta>(w, x, k, acc); break;
      case WeightPrefetch::kT0: row_dot_bf16_pairs<NC, WeightPrefetch::kT0>(w, x, k, acc); break;
      default: row_dot_bf16_pairs<NC, WeightPrefetch::kNone>(w, x, k, acc);
    }
  } else {
    constexpr int kChains = NC == 1 ? 4 : 2;
    constexpr int64_t kStep = int64_t(kChains) * kLanes;
    vec_t a[NC][kChains];
    for (int c = 0; c < NC; ++c)
      for (int u = 0; u < kChains; ++u) a[c][u] = vzero();
    int64_t i = 0;
    for (; i + kStep <= k; i += kStep)
      for (int u = 0; u < kChains; ++u) {
        const vec_t wv = vload(w + i + u * kLanes);
        for (int c = 0; c < NC; ++c) a[c][u] = vfma(wv, vload(x[c] + i + u * kLanes), a[c][u]);
      }
    for (; i + kLanes <= k; i += kLanes) {
      const vec_t wv = vload(w + i);
      for (int c = 0; c < NC; ++c) a[c][0] = vfma(wv, vload(x[c] + i), a[c][0]);
    }
    for (int c = 0; c < NC; ++c) {
      for (int u = 1; u < kChains; ++u) a[c][0] = vadd(a[c][0], a[c][u]);
      float s = reduce_add(a[c][0]);
      for (int64_t j = i; j < k; ++j) s += to_f32(w[j]) * x[c][j];
      acc[c] = s;
    }
  }
}
#else
template <int NC, typename T>
void row_dot(const T* w, const float* const* x, int64_t k, float* acc) {
  for (int c = 0; c < NC; ++c) {
    float s = 0.f;
    const float* xc = x[c];
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < k; ++j) s += to_f32(w[j]) * xc[j];
    acc[c] = s;
  }
}
#endif

template <typename T>
void row_dot_n(int nc, const T* w, const float* const* x, int64_t k, float* acc) {
  switch (nc) {
    case 1: row_dot<1>(w, x, k, acc); break;
    case 2: row_dot<2>(w, x, k, acc); break;
    case 3: row_dot<3>(w, x, k, acc); break;
    default: row_dot<kCols>(w, x, k, acc); break;
  }
}

// Output rows [row_begin, row_end); xf is x converted to f32 ([m, k]).
template <typename T>
void linear_rows(const LinearParams& p, const float* xf, int64_t row_begin, int64_t row_end) {
  const int64_t m = p.m, k = p.k;
  const T* weight = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const T* w = weight + r * k;
    const float b = bias != nullptr ? to_f32(bias[r]) : 0.f;
    for (int64_t c0 = 0; c0 < m; c0 += kCols) {
      const int nc = int(m - c0 < kCols ? m - c0 : kCols);
      const float* x[kCols];
      for (int c = 0; c < kCols; ++c) x[c] = xf + (c0 + (c < nc ? c : 0)) * k;
      float acc[kCols];
      row_dot_n<T>(nc, w, x, k, acc);
      for (int c = 0; c < nc; ++c) out[(c0 + c) * p.out_stride + r] = from_f32<T>(acc[c] + b);
    }
  }
}
// xf [m, k] = x in fp32; for bf16 weights in the vector build, each full group of kPair in pair
// order (row_dot_bf16_pairs reads it so).
template <typename T>
void convert_x(const LinearParams& p, float* xf) {
  for (int64_t c = 0; c < p.m; ++c) {
    const T* xr = static_cast<const T*>(p.x) + c * p.x_stride;
    float* xc = xf + c * p.k;
    int64_t j = 0;
#ifndef KOG_LINEAR_SCALAR
    if constexpr (std::is_same_v<T, bf16_t>)
      for (; j + kPair <= p.k; j += kPair)
        for (int e = 0; e < kPair; ++e) xc[j + e] = to_f32(xr[j + pair_index(e)]);
#endif
    for (; j < p.k; ++j) xc[j] = to_f32(xr[j]);
  }
}

// Thread `part` of queue.n_threads(), inside the caller's parallel region: chunks of about
// kChunkBytes of weight rows from the queue (its own slice first, then stolen ones).
constexpr int64_t kChunkBytes = 16 << 10;
template <typename T>
void linear_part_typed(const LinearParams& p, float* xf, RowQueue& queue, uint32_t epoch, int part) {
  convert_x<T>(p, xf);
  const int64_t rows = std::max<int64_t>(1, kChunkBytes / (p.k * int64_t(sizeof(T))));
  queue.start(epoch, part, (p.n + rows - 1) / rows);
  for (int64_t c; (c = queue.next(epoch, part)) >= 0;)
    linear_rows<T>(p, xf, c * rows, std::min(p.n, (c + 1) * rows));
}

template <typename T>
void linear_typed(const LinearParams& p, float* xf) {
  convert_x<T>(p, xf);
  constexpr int64_t kChunk = 16;  // rows per parallel work item
  const int64_t n_chunks = (p.n + kChunk - 1) / kChunk;
  parallel_for(n_chunks, p.n * p.k >= kLinearParallelMin, [&](int64_t t) {
    linear_rows<T>(p, xf, t * kChunk, (t + 1) * kChunk < p.n ? (t + 1) * kChunk : p.n);
  });
}

}  // namespace

// scratch: at least m * k floats.
void linear(const LinearParams& p, float* scratch) {
  dispatch_float(p.dtype, [&](auto tag) { linear_typed<decltype(tag)>(p, scratch); });
}

// Called by each thread of a parallel region the caller owns; scratch is the thread's own.
void linear_part(const LinearParams& p, float* scratch, RowQueue& queue, uint32_t epoch, int part) {
  dispatch_float(p.dtype, [&](auto tag) { linear_part_typed<decltype(tag)>(p, scratch, queue, epoch, part); });
}

}  // namespace kog::cpu::KOG_ISA_NS
