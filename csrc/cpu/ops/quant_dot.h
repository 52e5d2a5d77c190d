// ISA-local integer dot products of quantized weights with per-32 quantized activations, for
// csrc/cpu/ops/linear_quant.cpp. A "unit" is 32 consecutive elements of a row (one Q8_0/Q4_0/
// Q4_1/Q5_0/Q5_1 block, one K-quant sub-block): its weights arrive unpacked as 32 small integers q
// (a wvec) with float factors (a, b) such that w = a * q + b, and the activations of unit u are
// dx[u] * qx.
// So sum(w * x) = a * dx * sum(q * qx) + b * dx * sum(qx): an integer dot product, one float FMA,
// and a correction from the activation's block sums (kept apart, added once per row).
//   AVX2:     maddubs (u8 x s8 -> pairs of i16) then madd with ones (-> i32), 256-bit.
//   AVX-512:  VNNI dpbusd (u8 x s8, 4 products summed into i32, no i16 saturation); pairs of
//             units in one 512-bit register, single units in 256-bit (VL).
//   generic:  plain integer loops.
// Unsigned q must stay below 128 (maddubs: 2 * 127 * 127 fits i16; Q5's q <= 31, Q6_K's <= 63);
// signed Q8_0 weights use the abs/sign trick (|w| <= 128, so 2 * 128 * 127 fits too).
#pragma once
#include "cpu/vec.h"

// The accumulator must stay in registers: every helper of a row's loop is inlined into it.
#define KOG_QINLINE inline __attribute__((always_inline))

namespace kog::cpu::KOG_ISA_NS {

// One row of x quantized per unit u: q[32 u + i] int8, d[u] its scale, t[u] = d[u] * the sum of
// q over the unit, s[2 u + h] = d[u] * the sum of q over half h (elements 16 h .. 16 h + 15).
struct QRow {
  const int8_t* q;
  const float* d;
  const float* t;
  const float* s;
};

static inline float half_to_f32(uint16_t bits) {
  f16_t h;
  __builtin_memcpy(&h, &bits, 2);
  return float(h);
}

#if defined(__AVX2__)
#define KOG_QUANT_SIMD 1
using wvec = __m256i;  // 32 weight integers of one unit, as bytes

static inline wvec load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
static inline wvec nib_lo(wvec v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline wvec nib_hi(wvec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
// 16 bytes -> their low nibbles (elements 0-15), then their high nibbles (16-31).
static inline wvec nibbles16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
}
// Byte i = 16 where bit i of qh is set, else 0 (Q5_0/Q5_1's fifth bits, in nibbles16's order).
static inline wvec fifth_bits(uint32_t qh) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i = byte i / 8 of qh (each 128-bit lane holds qh)
      _mm256_set1_epi32(int32_t(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));  // byte i: 1 << (i % 8)
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}
static inline wvec or_bytes(wvec a, wvec b) { return _mm256_or_si256(a, b); }
// q + 16 where bit `bit` of the matching byte of h is set (Q5_K's fifth bit).
static inline wvec add_bit4(wvec q, wvec h, int bit) {
  const __m256i m = _mm256_set1_epi8(char(1 << bit));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(h, m), m);
  return _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}
// One Q6_K half (ql[64], qh[32]) -> its 4 units of 6-bit q (csrc/ops/quant.h).
static inline void q6_units(const uint8_t* ql, const uint8_t* qh, wvec u[4]) {
  const __m256i a = load32(ql), b = load32(ql + 32), h = load32(qh), m3 = _mm256_set1_epi8(3);
  // 16-bit shifts are safe: each byte is masked to its own bits before it can cross a byte.
  u[0] = _mm256_or_si256(nib_lo(a), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
  u[1] = _mm256_or_si256(nib_lo(b), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
  u[2] = _mm256_or_si256(nib_hi(a), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
  u[3] = _mm256_or_si256(nib_hi(b), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
}

// i32 lane j = sum of q * x over elements 4 j .. 4 j + 3 (so lanes 0-3: half 0, 4-7: half 1).
static inline __m256i idot_u8(__m256i q, __m256i x) {
#if defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}
static inline __m256i idot_s8(__m256i w, __m256i x) {
  return idot_u8(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
// out[i] = scale * byte i of `bytes` (unsigned), i < 8.
static inline void u8x8_to_f32(uint64_t bytes, float scale, float* out) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(bytes))));
  _mm256_storeu_ps(out, _mm256_mul_ps(v, _mm256_set1_ps(scale)));
}
// out[i] = scale * p[i], i < 8.
static inline void s8x8_to_f32(const int8_t* p, float scale, float* out) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(scale)));
}
static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Accumulates dot(W row, x row c) for NC rows of x at once (the weights unpacked once). Two
// accumulator slots S per row: consecutive units alternate between them, so two FMA chains are in
// flight (one chain is latency-bound: an FMA per unit waits for the previous one).
template <int NC>
struct QuantAcc {
  QRow x[NC];
  __m256 v[2][NC];
  float corr[2][NC];
#if defined(__AVX512VNNI__)
  __m512 v2[2][NC];
#endif

  explicit QuantAcc(const QRow* rows) {
    for (int c = 0; c < NC; ++c) {
      x[c] = rows[c];
      for (int s = 0; s < 2; ++s) {
        v[s][c] = _mm256_setzero_ps();
        corr[s][c] = 0.f;
#if defined(__AVX512VNNI__)
        v2[s][c] = _mm512_setzero_ps();
#endif
      }
    }
  }
  float sum(const QRow& r, int64_t u) const { return r.t[u]; }

  // Unit u: w = a * q + b.
  // NOTE: (i * dx) * a, not i * (a * dx): dx is broadcast straight from memory (a load, no ALU op)
  // and a once for all rows, so a row pays cvt, mul, fma on top of the integer dot.
  template <int S>
  KOG_QINLINE void unit(wvec q, int64_t u, float a, float b) {
    const __m256 av = _mm256_set1_ps(a);
    for (int c = 0; c < NC; ++c) {
      const __m256i i = idot_u8(q, load32(x[c].q + 32 * u));
      const __m256 id = _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_broadcast_ss(x[c].d + u));
      v[S][c] = _mm256_fmadd_ps(id, av, v[S][c]);
      corr[S][c] += b * sum(x[c], u);
    }
  }
  // Unit u of signed weights: w = a * q.
  template <int S>
  KOG_QINLINE void unit_s8(wvec q, int64_t u, float a) {
    const __m256 av = _mm256_set1_ps(a);
    for (int c = 0; c < NC; ++c) {
      const __m256i i = idot_s8(q, load32(x[c].q + 32 * u));
      const __m256 id = _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_broadcast_ss(x[c].d + u));
      v[S][c] = _mm256_fmadd_ps(id, av, v[S][c]);
    }
  }
  // Unit u with a scale per half: w = a_h * q + b_h on elements 16 h .. 16 h + 15.
  template <int S>
  KOG_QINLINE void unit_halves(wvec q, int64_t u, float a0, float a1, float b0, float b1) {
    const __m256 av = _mm256_set_m128(_mm_set1_ps(a1), _mm_set1_ps(a0));
    for (int c = 0; c < NC; ++c) {
      const __m256i i = idot_u8(q, load32(x[c].q + 32 * u));
      const __m256 id = _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_broadcast_ss(x[c].d + u));
      v[S][c] = _mm256_fmadd_ps(id, av, v[S][c]);
      corr[S][c] += b0 * x[c].s[2 * u] + b1 * x[c].s[2 * u + 1];
    }
  }
#if defined(__AVX512VNNI__)
  // Units u and u + 1 in one 512-bit register.
  template <int S>
  KOG_QINLINE void pair(wvec q0, wvec q1, int64_t u, float a0, float a1, float b0, float b1) {
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
    for (int c = 0; c < NC; ++c) {
      const __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(x[c].q + 32 * u));
      const __m512 sc = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a0 * x[c].d[u])),
                                           _mm256_set1_ps(a1 * x[c].d[u + 1]), 1);
      v2[S][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), sc, v2[S][c]);
      corr[S][c] += b0 * sum(x[c], u) + b1 * sum(x[c], u + 1);
    }
  }
  template <int S>
  KOG_QINLINE void pair_s8(wvec q0, wvec q1, int64_t u, float a0, float a1) {
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
    const __mmask64 neg = _mm512_movepi8_mask(w);
    const __m512i aw = _mm512_abs_epi8(w);
    for (int c = 0; c < NC; ++c) {
      const __m512i xv = _mm512_loadu_si512(x[c].q + 32 * u);
      const __m512i xs = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);  // x * sign(w)
      const __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xs);
      const __m512 sc = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a0 * x[c].d[u])),
                                           _mm256_set1_ps(a1 * x[c].d[u + 1]), 1);
      v2[S][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), sc, v2[S][c]);
    }
  }
  float result(int c) const {
    return hsum256(_mm256_add_ps(v[0][c], v[1][c])) + _mm512_reduce_add_ps(_mm512_add_ps(v2[0][c], v2[1][c])) +
           corr[0][c] + corr[1][c];
  }
#else
  // Units u and u + 1, one per slot (S only matters where a pair is one register).
  template <int S>
  KOG_QINLINE void pair(wvec q0, wvec q1, int64_t u, float a0, float a1, float b0, float b1) {
    unit<0>(q0, u, a0, b0);
    unit<1>(q1, u + 1, a1, b1);
  }
  template <int S>
  KOG_QINLINE void pair_s8(wvec q0, wvec q1, int64_t u, float a0, float a1) {
    unit_s8<0>(q0, u, a0);
    unit_s8<1>(q1, u + 1, a1);
  }
  float result(int c) const { return hsum256(_mm256_add_ps(v[0][c], v[1][c])) + corr[0][c] + corr[1][c]; }
#endif
};

#else  // generic: plain loops over bytes

struct wvec {
  uint8_t b[32];
};
static inline wvec load32(const void* p) {
  wvec v;
  __builtin_memcpy(v.b, p, 32);
  return v;
}
static inline wvec nib_lo(wvec v) {
  for (int i = 0; i < 32; ++i) v.b[i] &= 15;
  return v;
}
static inline wvec nib_hi(wvec v) {
  for (int i = 0; i < 32; ++i) v.b[i] >>= 4;
  return v;
}
static inline wvec nibbles16(const uint8_t* p) {
  wvec v;
  for (int i = 0; i < 16; ++i) {
    v.b[i] = p[i] & 15;
    v.b[i + 16] = p[i] >> 4;
  }
  return v;
}
static inline wvec add_bit4(wvec q, wvec h, int bit) {
  for (int i = 0; i < 32; ++i) q.b[i] |= ((h.b[i] >> bit) & 1) << 4;
  return q;
}
static inline wvec fifth_bits(uint32_t qh) {
  wvec v;
  for (int i = 0; i < 32; ++i) v.b[i] = uint8_t(((qh >> i) & 1) << 4);
  return v;
}
static inline wvec or_bytes(wvec a, const wvec& b) {
  for (int i = 0; i < 32; ++i) a.b[i] |= b.b[i];
  return a;
}
static inline void q6_units(const uint8_t* ql, const uint8_t* qh, wvec u[4]) {
  for (int l = 0; l < 32; ++l) {
    u[0].b[l] = uint8_t((ql[l] & 15) | ((qh[l] & 3) << 4));
    u[1].b[l] = uint8_t((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
    u[2].b[l] = uint8_t((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
    u[3].b[l] = uint8_t((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
  }
}

static inline void u8x8_to_f32(uint64_t bytes, float scale, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = scale * float((bytes >> (8 * i)) & 0xff);
}
static inline void s8x8_to_f32(const int8_t* p, float scale, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = scale * float(p[i]);
}

template <int NC>
struct QuantAcc {
  QRow x[NC];
  float v[NC];

  explicit QuantAcc(const QRow* rows) {
    for (int c = 0; c < NC; ++c) {
      x[c] = rows[c];
      v[c] = 0.f;
    }
  }
  static int32_t idot16(const uint8_t* q, const int8_t* x) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += int32_t(q[i]) * x[i];
    return s;
  }
  template <int S>
  KOG_QINLINE void unit_halves(const wvec& q, int64_t u, float a0, float a1, float b0, float b1) {
    for (int c = 0; c < NC; ++c) {
      const int8_t* xq = x[c].q + 32 * u;
      const float d = x[c].d[u];
      v[c] += a0 * d * float(idot16(q.b, xq)) + a1 * d * float(idot16(q.b + 16, xq + 16)) +
              b0 * x[c].s[2 * u] + b1 * x[c].s[2 * u + 1];
    }
  }
  template <int S>
  KOG_QINLINE void unit(const wvec& q, int64_t u, float a, float b) {
    for (int c = 0; c < NC; ++c) {
      const int8_t* xq = x[c].q + 32 * u;
      const int32_t i = idot16(q.b, xq) + idot16(q.b + 16, xq + 16);
      v[c] += a * x[c].d[u] * float(i) + b * x[c].t[u];
    }
  }
  template <int S>
  KOG_QINLINE void unit_s8(const wvec& q, int64_t u, float a) {
    for (int c = 0; c < NC; ++c) {
      const int8_t* xq = x[c].q + 32 * u;
      int32_t i = 0;
      for (int e = 0; e < 32; ++e) i += int32_t(int8_t(q.b[e])) * xq[e];
      v[c] += a * x[c].d[u] * float(i);
    }
  }
  template <int S>
  KOG_QINLINE void pair(const wvec& q0, const wvec& q1, int64_t u, float a0, float a1, float b0, float b1) {
    unit<0>(q0, u, a0, b0);
    unit<1>(q1, u + 1, a1, b1);
  }
  template <int S>
  KOG_QINLINE void pair_s8(const wvec& q0, const wvec& q1, int64_t u, float a0, float a1) {
    unit_s8<0>(q0, u, a0);
    unit_s8<1>(q1, u + 1, a1);
  }
  float result(int c) const { return v[c]; }
};
#endif

}  // namespace kog::cpu::KOG_ISA_NS
