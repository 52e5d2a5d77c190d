// ISA-local helpers for CPU kernel sources (csrc/cpu/ops/*.cpp, compiled once per ISA).
// Everything here lives in kog::cpu::KOG_ISA_NS so no inline function is shared between ISA
// builds (see cmake/KogCpuIsa.cmake); only compiler builtins, intrinsics and the OpenMP
// runtime are called.
#pragma once
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include "cpu/thread_pool.h"

#include <cstdint>
#include <cstring>

#include "common/dtype.h"

#ifndef KOG_ISA_NS
#error "compile CPU kernels through kog_add_cpu_kernels (defines KOG_ISA_NS)"
#endif

namespace kog::cpu::KOG_ISA_NS {

using bf16_t = uint16_t;  // bfloat16 storage: the top half of an IEEE fp32
using f16_t = _Float16;

// Work below this many elements stays on the calling thread: a fork costs more than it saves.
constexpr int64_t kParallelMinElems = 1 << 15;

static inline float bits_to_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

static inline float to_f32(float v) { return v; }
static inline float to_f32(bf16_t v) { return bits_to_f32(uint32_t(v) << 16); }
static inline float to_f32(f16_t v) { return float(v); }

template <typename T>
static inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) { return v; }
template <>
inline f16_t from_f32<f16_t>(float v) { return f16_t(v); }
// Round to nearest even; NaN stays a (quiet) NaN. Branch-free, so loops over it vectorize.
template <>
inline bf16_t from_f32<bf16_t>(float v) {
  const uint32_t u = f32_to_bits(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return bf16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// exp(x) = 2^n exp(r), n = round(x / ln2), |r| <= ln2/2, exp(r) by its degree-6 Taylor
// polynomial. The shared core of fast_exp and the attention kernels' fast_exp_v, on a float or a
// GCC vector of floats V: xc is x clamped to [-87, 88]; returns exp(r) and sets `shifted`, whose
// low mantissa bits hold n (n as an integer = bits(shifted) - 0x4B400000).
template <typename V>
static inline V exp_reduced(V xc, V& shifted) {
  shifted = xc * 1.44269504f + 12582912.f;  // + 1.5 * 2^23 rounds to an integer
  const V n = shifted - 12582912.f;
  const V r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split in two: exact n * hi
  V poly = V{} + 1.f / 720.f;
  poly = poly * r + 1.f / 120.f;
  poly = poly * r + 1.f / 24.f;
  poly = poly * r + 1.f / 6.f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.f;
  poly = poly * r + 1.f;
  return poly;
}

// exp(x) to ~2 ulp with no libm call (SiLU, the attention merge); vectorizes in an omp simd
// loop. Returns 0 below -87 (incl. -inf, the masked scores).
static inline float fast_exp(float x) {
  float shifted;
  const float poly = exp_reduced(x < -87.f ? -87.f : (x > 88.f ? 88.f : x), shifted);
  const int32_t ni = int32_t(f32_to_bits(shifted)) - 0x4B400000;  // n as an integer
  const float two_n = bits_to_f32(uint32_t(ni + 127) << 23);
  return x < -87.f ? 0.f : poly * two_n;
}

// fn(r) for r in [0, n): split over a new parallel region when `parallel` and the caller is not
// already inside one (the decode executor runs small ops on one thread of its region), else on
// the calling thread as a plain loop (a region costs a wake-up: more than the whole op for one
// decode row).
template <typename Fn>
static inline void for_each_row(int64_t n, bool parallel, Fn&& fn) {
  parallel_for(n, parallel, fn);
}

// Sum of the lanes of a native fp32 vector (halving shuffles; AVX2 and AVX-512 builds only).
#if defined(__AVX512F__)
static inline float reduce_add(__m512 v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__)
static inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Calls fn.template operator()<T>() with T the storage type of dtype.
template <typename Fn>
static inline void dispatch_float(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: fn(float{}); break;
    case DType::kF16: fn(f16_t{}); break;
    case DType::kBF16: fn(bf16_t{}); break;
    default: break;  // the binding has already rejected other dtypes
  }
}

}  // namespace kog::cpu::KOG_ISA_NS
