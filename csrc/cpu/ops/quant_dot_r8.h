// ISA-local GEMV over row-interleaved quantized weights (Q4_0_R8, Q4_1_R8, Q5_0_R8, Q5_1_R8, Q8_0_R8,
// Q4_K_R8, Q5_K_R8, Q6_K_R8: csrc/ops/quant.h),
// for csrc/cpu/ops/linear_quant.cpp. One group = 8 weight rows; per 32-element unit:
//   a 32-byte chunk of the packed quants holds 4 weights of each of the 8 rows (unpacked Q4: two
//   such vectors per chunk); x's matching 4 int8 are broadcast to every row, so one maddubs (AVX2)
//   or dpbusd (VNNI) makes 8 rows' partial dots at once, summed per row in the vector's lanes;
//   the unit's scales then apply as vectors of 8 rows: out_r += d_r dx sum_r (+ m_r t for Q4_1,
//   -8 d_r t for Q4_0, t = dx * the sum of x's unit).
// That is ~2 instructions per row and unit where a row-major dot spends ~10 on the scales and
// the horizontal structure (PERFORMANCE.md, issue 17: the decode GEMV was instruction-bound).
// Exactness: the integer sums are exact (Q4 on AVX2: 8 pair sums of |q x| <= 2 * 15 * 127 stay
// below 2^15 in i16); only the f32 accumulation order differs from the row-major kernel.
#pragma once
#include "cpu/ops/quant_dot.h"
#include "ops/quant.h"

namespace kog::cpu::KOG_ISA_NS {

// One row of x quantized once per 32-element unit to int16: q[32 u + i] = rint(x / d[u]),
// d[u] = amax / (127 * 256), so |x - d q| <= amax / 65024: the bound of two int8 stages (QRow),
// for the Q8_0_R8 GEMV with x_stages 2.
struct X16Row {
  const int16_t* q;
  const float* d;
};

// Output rows 8 g .. 8 g + 7 for NC quantized rows of x: out[c][r] for the unit range of the row.
#if defined(__AVX2__)
// Columns (quantized rows of x) per pass over a group: each takes 3 accumulators (i-sum, f32 sum,
// correction); AVX-512 has 32 vector registers, AVX2 16.
#if defined(__AVX512F__)
constexpr int kR8Cols = 4;
#else
constexpr int kR8Cols = 2;
#endif

static inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
static inline __m256 halves8(const half_bits* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// The fifth bits of one Q5 chunk of 8 rows: qh = the unit's qh chunk (row r's 32-bit word in lane
// r); byte j of lane r = 16 where bit `first` + j of that word is set (first = 4 ch for the low
// nibbles of qs chunk ch, 16 + 4 ch for the high ones).
static inline __m256i fifth_bits_r8(__m256i qh, int first) {
  const int byte = first / 8, shift = first % 8;  // the lane's byte holding bits first .. first + 3
  const __m256i idx = _mm256_add_epi8(_mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0,
                                                       4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12),
                                      _mm256_set1_epi8(char(byte)));
  const __m256i bit = _mm256_set1_epi32(int32_t(0x08040201u << shift));  // byte j: 1 << (shift + j)
  const __m256i spread = _mm256_shuffle_epi8(qh, idx);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Q4_0_R8 / Q4_1_R8 (kMin) and Q5_0_R8 / Q5_1_R8 (kFifth: q = nibble + 16 * the fifth bit from the
// unit's qh chunk): w = d q + m (Q4_1, Q5_1) or d (q - 8) / d (q - 16) (Q4_0, Q5_0). Q4's maddubs
// pair sums (<= 2 * 15 * 127) add up in i16 over the unit; Q5's (<= 2 * 31 * 127) are widened to
// i32 at every chunk.
template <int NC, bool kMin, bool kFifth, class Unit>
KOG_QINLINE void group_q4_r8(const Unit* units, int64_t nb, const QRow* x, __m256* out) {
  const __m256i low4 = _mm256_set1_epi8(15);
  __m256 acc[NC], cor[NC];
  for (int c = 0; c < NC; ++c) acc[c] = cor[c] = _mm256_setzero_ps();
  for (int64_t u = 0; u < nb; ++u) {
    const Unit& b = units[u];
    __m256i qh = _mm256_setzero_si256();
    if constexpr (kFifth) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh));
    __m256i s[NC];
    for (int c = 0; c < NC; ++c) s[c] = _mm256_setzero_si256();
    for (int ch = 0; ch < 4; ++ch) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * ch));
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (kFifth) {
        lo = _mm256_or_si256(lo, fifth_bits_r8(qh, 4 * ch));
        hi = _mm256_or_si256(hi, fifth_bits_r8(qh, 16 + 4 * ch));
      }
      for (int c = 0; c < NC; ++c) {
        const int8_t* xq = x[c].q + 32 * u + 4 * ch;
#if defined(__AVX512VNNI__)
        s[c] = _mm256_dpbusd_epi32(s[c], lo, bcast4(xq));
        s[c] = _mm256_dpbusd_epi32(s[c], hi, bcast4(xq + 16));
#else
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xq)), _mm256_maddubs_epi16(hi, bcast4(xq + 16)));
        if constexpr (kFifth) {
          s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
        } else {
          s[c] = _mm256_add_epi16(s[c], p);
        }
#endif
      }
    }
    const __m256 d = halves8(b.d);
    __m256 m;
    if constexpr (kMin) {
      m = halves8(b.m);
    } else {
      m = _mm256_mul_ps(d, _mm256_set1_ps(kFifth ? -16.f : -8.f));
    }
    for (int c = 0; c < NC; ++c) {
#if defined(__AVX512VNNI__)
      const __m256i i = s[c];
#else
      const __m256i i = kFifth ? s[c] : _mm256_madd_epi16(s[c], _mm256_set1_epi16(1));
#endif
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_broadcast_ss(x[c].d + u)), acc[c]);
      cor[c] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(x[c].t + u), cor[c]);
    }
  }
  for (int c = 0; c < NC; ++c) out[c] = _mm256_add_ps(acc[c], cor[c]);
}

// Q8_0_R8: signed q, w = d q. |q| <= 128 and |x| <= 127 keep maddubs' pair sums in i16 (abs/sign).
template <int NC>
KOG_QINLINE void group_q8_r8(const BlockQ8_0x8* units, int64_t nb, const QRow* x, __m256* out) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t u = 0; u < nb; ++u) {
    const BlockQ8_0x8& b = units[u];
    __m256i s[NC];
    for (int c = 0; c < NC; ++c) s[c] = _mm256_setzero_si256();
    for (int ch = 0; ch < 8; ++ch) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * ch));
      const __m256i aw = _mm256_abs_epi8(w);
      for (int c = 0; c < NC; ++c) {
        const __m256i xs = _mm256_sign_epi8(bcast4(x[c].q + 32 * u + 4 * ch), w);
#if defined(__AVX512VNNI__)
        s[c] = _mm256_dpbusd_epi32(s[c], aw, xs);
#else
        s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), _mm256_set1_epi16(1)));
#endif
      }
    }
    const __m256 d = halves8(b.d);
    for (int c = 0; c < NC; ++c)
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[c]), _mm256_mul_ps(d, _mm256_broadcast_ss(x[c].d + u)), acc[c]);
  }
  for (int c = 0; c < NC; ++c) out[c] = acc[c];
}

// Q4_K_R8 and Q5_K_R8 (kHigh): per super-block, the 8 rows' 6-bit scales and mins decoded as
// vectors of 8 rows (k_scale_min on the three 32-bit words, one per scale chunk), then per
// sub-block j the nibbles as in group_q4_r8 (Q5_K: plus 16 where bit j of the element's qh byte is
// set, qh chunk g beside qs chunk 8 c + g): w = a_j q - m_j, a_j = d sc_j, m_j = dmin mn_j.
// Q5_K's pair sums reach 2 * 31 * 127, so its maddubs are widened to i32 at every step.
template <int NC, bool kHigh, class Block>
KOG_QINLINE void group_qk_r8(const Block* blocks, int64_t nb, const QRow* x, __m256* out) {
  const __m256i low4 = _mm256_set1_epi8(15), low6 = _mm256_set1_epi8(63), low2 = _mm256_set1_epi8(3);
  __m256 acc[NC], cor[NC];
  for (int c = 0; c < NC; ++c) acc[c] = cor[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const Block& b = blocks[i];
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.scales));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.scales + 32));
    const __m256i w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.scales + 64));
    // Byte j of each row's word: sc (mn) of sub-block j (lo) and j + 4 (hi).
    const __m256i sc_lo = _mm256_and_si256(w0, low6), mn_lo = _mm256_and_si256(w1, low6);
    const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(w2, low4),
                                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, 6), low2), 4));
    const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), low4),
                                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, 6), low2), 4));
    const __m256 d = halves8(b.d), dmin = halves8(b.dmin);
    auto byte_j = [](__m256i v, int j) __attribute__((always_inline)) {
      return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * j), _mm256_set1_epi32(255)));
    };
    for (int ch = 0; ch < 4; ++ch) {  // sub-blocks 2 ch (low nibbles) and 2 ch + 1 (high)
      const int64_t u = 8 * i + 2 * ch;  // x's unit of the low sub-block
      __m256i s0[NC], s1[NC];
      for (int c = 0; c < NC; ++c) s0[c] = s1[c] = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 256 * ch + 32 * g));
        __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if constexpr (kHigh) {  // byte for byte, qh chunk g holds the fifth bits of qs chunk 8 ch + g
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * g));
          lo = add_bit4(lo, h, 2 * ch), hi = add_bit4(hi, h, 2 * ch + 1);
        }
        for (int c = 0; c < NC; ++c) {
          const int8_t* xq = x[c].q + 32 * u + 4 * g;
#if defined(__AVX512VNNI__)
          s0[c] = _mm256_dpbusd_epi32(s0[c], lo, bcast4(xq));
          s1[c] = _mm256_dpbusd_epi32(s1[c], hi, bcast4(xq + 32));
#else
          if constexpr (kHigh) {
            const __m256i one = _mm256_set1_epi16(1);
            s0[c] = _mm256_add_epi32(s0[c], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, bcast4(xq)), one));
            s1[c] = _mm256_add_epi32(s1[c], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, bcast4(xq + 32)), one));
          } else {
            s0[c] = _mm256_add_epi16(s0[c], _mm256_maddubs_epi16(lo, bcast4(xq)));
            s1[c] = _mm256_add_epi16(s1[c], _mm256_maddubs_epi16(hi, bcast4(xq + 32)));
          }
#endif
        }
      }
      const int j0 = 2 * ch, j1 = 2 * ch + 1;
      const __m256 a0 = _mm256_mul_ps(d, byte_j(j0 < 4 ? sc_lo : sc_hi, j0 % 4));
      const __m256 a1 = _mm256_mul_ps(d, byte_j(j1 < 4 ? sc_lo : sc_hi, j1 % 4));
      const __m256 m0 = _mm256_mul_ps(dmin, byte_j(j0 < 4 ? mn_lo : mn_hi, j0 % 4));
      const __m256 m1 = _mm256_mul_ps(dmin, byte_j(j1 < 4 ? mn_lo : mn_hi, j1 % 4));
      for (int c = 0; c < NC; ++c) {
#if defined(__AVX512VNNI__)
        const __m256i i0 = s0[c], i1 = s1[c];
#else
        __m256i i0 = s0[c], i1 = s1[c];
        if constexpr (!kHigh) {
          i0 = _mm256_madd_epi16(i0, _mm256_set1_epi16(1));
          i1 = _mm256_madd_epi16(i1, _mm256_set1_epi16(1));
        }
#endif
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(a0, _mm256_broadcast_ss(x[c].d + u)), acc[c]);
        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(a1, _mm256_broadcast_ss(x[c].d + u + 1)), acc[c]);
        cor[c] = _mm256_fnmadd_ps(m0, _mm256_broadcast_ss(x[c].t + u), cor[c]);
        cor[c] = _mm256_fnmadd_ps(m1, _mm256_broadcast_ss(x[c].t + u + 1), cor[c]);
      }
    }
  }
  for (int c = 0; c < NC; ++c) out[c] = _mm256_add_ps(acc[c], cor[c]);
}

// Q6_K_R8: per super-block the 8 rows' d and int8 scales as vectors of 8 rows; per 32-element unit
// (half h, part t) and 4-element group g: 6-bit q from ql chunk 16 h + 8 (t % 2) + g (nibble
// t / 2) and qh chunk 8 h + g (bits 2 t, 2 t + 1); w = d sc (q - 32), the scale per 16 elements
// (g < 4: the unit's first). The -32 goes into the correction with x's half sums.
template <int NC>
KOG_QINLINE void group_q6k_r8(const BlockQ6_Kx8* blocks, int64_t nb, const QRow* x, __m256* out) {
  const __m256i low4 = _mm256_set1_epi8(15), low2 = _mm256_set1_epi8(3);
  __m256 acc[NC], cor[NC];
  for (int c = 0; c < NC; ++c) acc[c] = cor[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const BlockQ6_Kx8& b = blocks[i];
    const __m256 d = halves8(b.d);
    auto scale = [&](int j) __attribute__((always_inline)) {  // d * scales[j] of the 8 rows
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.scales + 32 * (j / 4)));
      return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * (j % 4)), 24)));
    };
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < 4; ++t) {
        const int64_t u = 8 * i + 4 * h + t;
        __m256i s[2][NC];
        for (int c = 0; c < NC; ++c) s[0][c] = s[1][c] = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 32 * (16 * h + 8 * (t % 2) + g)));
          const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * (8 * h + g)));
          const __m256i lo = t < 2 ? _mm256_and_si256(a, low4) : _mm256_and_si256(_mm256_srli_epi16(a, 4), low4);
          // 16-bit shifts are safe: each byte is masked to its own 2 bits before moving up by 4.
          const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * t), low2), 4));
          for (int c = 0; c < NC; ++c) {
            const __m256i xb = bcast4(x[c].q + 32 * u + 4 * g);
#if defined(__AVX512VNNI__)
            s[g / 4][c] = _mm256_dpbusd_epi32(s[g / 4][c], q, xb);
#else  // q <= 63: a pair sum <= 2 * 63 * 127 fits i16, then widened
            s[g / 4][c] = _mm256_add_epi32(s[g / 4][c], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xb), _mm256_set1_epi16(1)));
#endif
          }
        }
        const __m256 a0 = scale(8 * h + 2 * t), a1 = scale(8 * h + 2 * t + 1);
        const __m256 m0 = _mm256_mul_ps(a0, _mm256_set1_ps(32.f)), m1 = _mm256_mul_ps(a1, _mm256_set1_ps(32.f));
        for (int c = 0; c < NC; ++c) {
          const __m256 dx = _mm256_broadcast_ss(x[c].d + u);
          acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0][c]), _mm256_mul_ps(a0, dx), acc[c]);
          acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1][c]), _mm256_mul_ps(a1, dx), acc[c]);
          cor[c] = _mm256_fnmadd_ps(m0, _mm256_broadcast_ss(x[c].s + 2 * u), cor[c]);
          cor[c] = _mm256_fnmadd_ps(m1, _mm256_broadcast_ss(x[c].s + 2 * u + 1), cor[c]);
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c) out[c] = _mm256_add_ps(acc[c], cor[c]);
}

// out[c * 8 + r] = dot(row 8 g + r, x row c) for c < NC (group g at `group`, k / 32 units).
template <int NC>
void group_dot_r8(QuantType type, const uint8_t* group, int64_t k, const QRow* x, float* out) {
  __m256 v[NC];
  const int64_t nb = k / kQuantBlock;
  switch (type) {
    case QuantType::kQ4_K_R8:
      group_qk_r8<NC, false>(reinterpret_cast<const BlockQ4_Kx8*>(group), k / kSuperBlock, x, v);
      break;
    case QuantType::kQ5_K_R8:
      group_qk_r8<NC, true>(reinterpret_cast<const BlockQ5_Kx8*>(group), k / kSuperBlock, x, v);
      break;
    case QuantType::kQ6_K_R8:
      group_q6k_r8<NC>(reinterpret_cast<const BlockQ6_Kx8*>(group), k / kSuperBlock, x, v);
      break;
    case QuantType::kQ4_0_R8:
      group_q4_r8<NC, false, false>(reinterpret_cast<const BlockQ4_0x8*>(group), nb, x, v);
      break;
    case QuantType::kQ4_1_R8:
      group_q4_r8<NC, true, false>(reinterpret_cast<const BlockQ4_1x8*>(group), nb, x, v);
      break;
    case QuantType::kQ5_0_R8:
      group_q4_r8<NC, false, true>(reinterpret_cast<const BlockQ5_0x8*>(group), nb, x, v);
      break;
    case QuantType::kQ5_1_R8:
      group_q4_r8<NC, true, true>(reinterpret_cast<const BlockQ5_1x8*>(group), nb, x, v);
      break;
    default:  // kQ8_0_R8 (the callers dispatch packed types only)
      group_q8_r8<NC>(reinterpret_cast<const BlockQ8_0x8*>(group), nb, x, v);
      break;
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + 8 * c, v[c]);
}

// Q8_0_R8 against x quantized once to int16 per unit (X16Row): w (sign-extended to i16) times 4
// values of x broadcast, madd into i32 pairs per row (rows 0-3 and 4-7 in two accumulators), one
// hadd per unit. |w| <= 128, |X| <= 32512: a unit's sum stays below 2^28.
template <int NC>
KOG_QINLINE void group_q8_r8_x16(const BlockQ8_0x8* units, int64_t nb, const X16Row* x, __m256* out) {
  // hadd leaves rows as 0 1 4 5 2 3 6 7; the unit's scales are permuted the same way.
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t u = 0; u < nb; ++u) {
    const BlockQ8_0x8& b = units[u];
    __m256i s0[NC], s1[NC];
    for (int c = 0; c < NC; ++c) s0[c] = s1[c] = _mm256_setzero_si256();
    for (int ch = 0; ch < 8; ++ch) {
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 32 * ch)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 32 * ch + 16)));
      for (int c = 0; c < NC; ++c) {
        int64_t xv;
        __builtin_memcpy(&xv, x[c].q + 32 * u + 4 * ch, 8);
        const __m256i xb = _mm256_set1_epi64x(xv);
#if defined(__AVX512VNNI__)
        s0[c] = _mm256_dpwssd_epi32(s0[c], w0, xb);
        s1[c] = _mm256_dpwssd_epi32(s1[c], w1, xb);
#else
        s0[c] = _mm256_add_epi32(s0[c], _mm256_madd_epi16(w0, xb));
        s1[c] = _mm256_add_epi32(s1[c], _mm256_madd_epi16(w1, xb));
#endif
      }
    }
    const __m256 d = _mm256_permutevar8x32_ps(halves8(b.d), order);
    for (int c = 0; c < NC; ++c)
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(s0[c], s1[c])),
                               _mm256_mul_ps(d, _mm256_broadcast_ss(x[c].d + u)), acc[c]);
  }
  for (int c = 0; c < NC; ++c) out[c] = _mm256_permutevar8x32_ps(acc[c], order);  // the order is its own inverse
}

template <int NC>
void group_dot_r8_x16(const uint8_t* group, int64_t k, const X16Row* x, float* out) {
  __m256 v[NC];
  group_q8_r8_x16<NC>(reinterpret_cast<const BlockQ8_0x8*>(group), k / kQuantBlock, x, v);
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + 8 * c, v[c]);
}

#else  // generic: the same sums, one row at a time

constexpr int kR8Cols = 4;

template <int NC>
void group_dot_r8_x16(const uint8_t* group, int64_t k, const X16Row* x, float* out) {
  const BlockQ8_0x8* units = reinterpret_cast<const BlockQ8_0x8*>(group);
  for (int c = 0; c < NC * kPackRows; ++c) out[c] = 0.f;
  for (int64_t u = 0; u < k / kQuantBlock; ++u)
    for (int r = 0; r < kPackRows; ++r)
      for (int c = 0; c < NC; ++c) {
        int32_t s = 0;
        for (int ch = 0; ch < 8; ++ch)
          for (int j = 0; j < 4; ++j) s += int32_t(units[u].qs[32 * ch + 4 * r + j]) * x[c].q[32 * u + 4 * ch + j];
        out[c * kPackRows + r] += half_to_f32(units[u].d[r]) * x[c].d[u] * float(s);
      }
}

// The 6-bit scale (or min, mn) of sub-block j from a row's 12 scale bytes (csrc/ops/quant.h).
static inline int k_scale6(const uint8_t* q, int j, bool mn) {
  if (j < 4) return q[j + (mn ? 4 : 0)] & 63;
  return mn ? (q[j + 4] >> 4) | ((q[j] >> 6) << 4) : (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
}

// Row r of one Q4_0/Q4_1 (kMin) or Q5_0/Q5_1 (kFifth) unit against x's unit xq: s = sum(q x),
// w = d q + m.
template <bool kMin, bool kFifth, class Unit>
static inline void unit_q4_r8(const Unit& b, int r, const int8_t* xq, int32_t& s, float& d, float& m) {
  uint32_t h = 0;
  if constexpr (kFifth) __builtin_memcpy(&h, b.qh + 4 * r, 4);
  for (int ch = 0; ch < 4; ++ch)
    for (int j = 0; j < 4; ++j) {
      const uint8_t byte = b.qs[32 * ch + 4 * r + j];
      const int e = 4 * ch + j;
      s += int32_t((byte & 15) | ((h >> e) & 1) << 4) * xq[e] +
           int32_t((byte >> 4) | ((h >> (e + 16)) & 1) << 4) * xq[16 + e];
    }
  d = half_to_f32(b.d[r]);
  if constexpr (kMin) {
    m = half_to_f32(b.m[r]);
  } else {
    m = (kFifth ? -16.f : -8.f) * d;
  }
}

template <int NC>
void group_dot_r8(QuantType type, const uint8_t* group, int64_t k, const QRow* x, float* out) {
  const int64_t nb = k / kQuantBlock;
  for (int c = 0; c < NC * kPackRows; ++c) out[c] = 0.f;
  if (type == QuantType::kQ6_K_R8) {
    const BlockQ6_Kx8* blocks = reinterpret_cast<const BlockQ6_Kx8*>(group);
    for (int64_t i = 0; i < k / kSuperBlock; ++i)
      for (int r = 0; r < kPackRows; ++r) {
        const BlockQ6_Kx8& b = blocks[i];
        const float d = half_to_f32(b.d[r]);
        for (int h = 0; h < 2; ++h)
          for (int t = 0; t < 4; ++t) {
            const int64_t u = 8 * i + 4 * h + t;
            for (int part = 0; part < 2; ++part) {  // elements 16 part .. 16 part + 15 of the unit
              const int j = 8 * h + 2 * t + part;
              const float a = d * float(b.scales[32 * (j / 4) + 4 * r + j % 4]);
              for (int c = 0; c < NC; ++c) {
                int32_t acc = 0;
                for (int g = 4 * part; g < 4 * part + 4; ++g)
                  for (int e = 0; e < 4; ++e) {
                    const uint8_t lo = b.ql[32 * (16 * h + 8 * (t % 2) + g) + 4 * r + e];
                    const uint8_t hi = b.qh[32 * (8 * h + g) + 4 * r + e];
                    const int q = ((lo >> (4 * (t / 2))) & 15) | ((hi >> (2 * t)) & 3) << 4;
                    acc += int32_t(q) * x[c].q[32 * u + 4 * g + e];
                  }
                out[c * kPackRows + r] += a * x[c].d[u] * float(acc) - 32.f * a * x[c].s[2 * u + part];
              }
            }
          }
      }
    return;
  }
  if (type == QuantType::kQ4_K_R8 || type == QuantType::kQ5_K_R8) {
    // Q5_K_R8 is Q4_K_R8's layout with the 8 qh chunks between the scales and qs.
    const bool q5 = type == QuantType::kQ5_K_R8;
    const int64_t block = q5 ? int64_t(sizeof(BlockQ5_Kx8)) : int64_t(sizeof(BlockQ4_Kx8));
    for (int64_t i = 0; i < k / kSuperBlock; ++i)
      for (int r = 0; r < kPackRows; ++r) {
        const BlockQ4_Kx8& b = *reinterpret_cast<const BlockQ4_Kx8*>(group + i * block);  // d, dmin, scales
        const uint8_t* qh = q5 ? reinterpret_cast<const BlockQ5_Kx8*>(group + i * block)->qh : nullptr;
        const uint8_t* qs = q5 ? reinterpret_cast<const BlockQ5_Kx8*>(group + i * block)->qs : b.qs;
        uint8_t sc[12];
        for (int s = 0; s < 3; ++s)
          for (int j = 0; j < 4; ++j) sc[4 * s + j] = b.scales[32 * s + 4 * r + j];
        for (int sb = 0; sb < 8; ++sb) {
          const float a = half_to_f32(b.d[r]) * float(k_scale6(sc, sb, false));
          const float m = half_to_f32(b.dmin[r]) * float(k_scale6(sc, sb, true));
          const int64_t u = 8 * i + sb;
          for (int c = 0; c < NC; ++c) {
            int32_t acc = 0;
            for (int g = 0; g < 8; ++g)
              for (int j = 0; j < 4; ++j) {
                const uint8_t byte = qs[256 * (sb / 2) + 32 * g + 4 * r + j];
                const int fifth = q5 ? ((qh[32 * g + 4 * r + j] >> sb) & 1) << 4 : 0;
                acc += int32_t(((byte >> (4 * (sb % 2))) & 15) | fifth) * x[c].q[32 * u + 4 * g + j];
              }
            out[c * kPackRows + r] += a * x[c].d[u] * float(acc) - m * x[c].t[u];
          }
        }
      }
    return;
  }
  for (int64_t u = 0; u < nb; ++u) {
    for (int r = 0; r < kPackRows; ++r) {
      for (int c = 0; c < NC; ++c) {
        const int8_t* xq = x[c].q + 32 * u;
        int32_t s = 0;
        float d, m;
        if (type == QuantType::kQ8_0_R8) {
          const BlockQ8_0x8& b = reinterpret_cast<const BlockQ8_0x8*>(group)[u];
          for (int ch = 0; ch < 8; ++ch)
            for (int j = 0; j < 4; ++j) s += int32_t(b.qs[32 * ch + 4 * r + j]) * xq[4 * ch + j];
          d = half_to_f32(b.d[r]), m = 0.f;
        } else {
          switch (type) {
            case QuantType::kQ4_0_R8:
              unit_q4_r8<false, false>(reinterpret_cast<const BlockQ4_0x8*>(group)[u], r, xq, s, d, m);
              break;
            case QuantType::kQ4_1_R8:
              unit_q4_r8<true, false>(reinterpret_cast<const BlockQ4_1x8*>(group)[u], r, xq, s, d, m);
              break;
            case QuantType::kQ5_0_R8:
              unit_q4_r8<false, true>(reinterpret_cast<const BlockQ5_0x8*>(group)[u], r, xq, s, d, m);
              break;
            default:  // kQ5_1_R8
              unit_q4_r8<true, true>(reinterpret_cast<const BlockQ5_1x8*>(group)[u], r, xq, s, d, m);
              break;
          }
        }
        out[c * kPackRows + r] += d * x[c].d[u] * float(s) + m * x[c].t[u];
      }
    }
  }
}
#endif

}  // namespace kog::cpu::KOG_ISA_NS
