// CPU linear over GGUF-quantized weights. Contract: csrc/ops/linear_quant.h; the integer dot
// products per ISA: csrc/cpu/ops/quant_dot.h.
// x is quantized once per call (per 32-element unit: int8, scale, half sums); then each weight row
// is unpacked block by block, once for up to kCols rows of x, as in csrc/cpu/ops/linear.cpp.
#include "cpu/kernels.h"
#include "cpu/ops/quant_dot.h"
#include "cpu/ops/quant_dot_r8.h"

#include <algorithm>
#include <type_traits>

namespace kog::cpu::KOG_ISA_NS {

void linear_dequant(const LinearQuantParams& p, int64_t row_bytes);  // csrc/cpu/ops/linear_dequant.cpp

namespace {

constexpr int kCols = 4;
// Below this many weight bytes a call runs on the calling thread.
constexpr int64_t kParallelMinBytes = 1 << 15;
// Accumulator slots (QuantAcc) as values for generic lambdas.
constexpr std::integral_constant<int, 0> kSlot0{};
constexpr std::integral_constant<int, 1> kSlot1{};

// ---- x quantized per unit (the layout of LinearQuantParams::scratch) ----------------------------

// One unit of 32 floats: q = round-to-nearest-even(x / d), d = amax / 127: |x - d q| <= d / 2
// elementwise. Writes q[0, 32), d, t = d * sum(q) and s[0, 2) = d * the sums of its halves.
void quantize_unit(const float* xf, int8_t* q, float* d, float* t, float* s) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) {
    const float a = __builtin_fabsf(xf[i]);
    amax = a > amax || a != a ? a : amax;  // a NaN x makes d NaN, so its rows come out NaN
  }
  const float du = amax / 127.f, id = du != 0.f ? 1.f / du : 0.f;
  int32_t sum[2] = {0, 0};
  for (int i = 0; i < 32; ++i) {
    // rint of the rounded product, as the reference does. NOTE: not the (v + 1.5 * 2^23) - 1.5 * 2^23
    // trick: GCC contracts x * id + 1.5 * 2^23 into an FMA where the ISA has one, which rounds the
    // exact product and so sometimes the other way.
    const int32_t qi = int32_t(__builtin_rintf(xf[i] * id));
    q[i] = int8_t(qi);
    sum[i / 16] += qi;
  }
  *d = du;
  *t = du * float(sum[0] + sum[1]);
  s[0] = du * float(sum[0]);
  s[1] = du * float(sum[1]);
}

// One row of x as `stages` quantized rows (QuantizedX rows stages * c + j): stage 0 is x, stage 1
// (x_stages 2) the residual x - d0 q0 of stage 0, quantized the same way, so that
// x = d0 q0 + d1 q1 + e with |e| <= amax / (2 * 127 * 254) per unit.
// Where one quantized row of x is written (the mutable side of QRow).
struct QRowOut {
  int8_t* q;
  float* d;
  float* t;
  float* s;
};

template <typename T>
void quantize_row(const T* x, int64_t k, int stages, const QRowOut* rows) {
  for (int64_t u = 0; u < k / 32; ++u) {
    float xf[32];
    for (int i = 0; i < 32; ++i) xf[i] = to_f32(x[32 * u + i]);
    for (int j = 0; j < stages; ++j) {
      const QRowOut& r = rows[j];
      int8_t* q = r.q + 32 * u;
      float* d = r.d + u;
      quantize_unit(xf, q, d, r.t + u, r.s + 2 * u);
      for (int i = 0; i < 32; ++i) xf[i] -= *d * float(q[i]);  // the residual, exact in f32 but for the rounding of d q
    }
  }
}

struct QuantizedX {
  int8_t* q;  // [m, k]
  float* d;   // [m, k / 32]
  float* t;   // [m, k / 32]
  float* s;   // [m, k / 16]
  int64_t k;
  QRow row(int64_t c) const { return {q + c * k, d + c * (k / 32), t + c * (k / 32), s + c * (k / 16)}; }
  QRowOut out_row(int64_t c) const { return {q + c * k, d + c * (k / 32), t + c * (k / 32), s + c * (k / 16)}; }
};

// x's rows quantized in p.x_stages stages each (scratch layout: linear_quant_scratch_bytes of
// m * x_stages rows). parallel: split the rows of x over a region of their own when there are
// enough of them.
QuantizedX quantize_x(const LinearQuantParams& p, bool parallel = true) {
  const int64_t rows = p.m * p.x_stages;
  int8_t* q = static_cast<int8_t*>(p.scratch);
  float* d = reinterpret_cast<float*>(q + rows * p.k);
  QuantizedX qx{q, d, d + rows * (p.k / 32), d + 2 * rows * (p.k / 32), p.k};
  for_each_row(p.m, parallel && p.m * p.k >= kParallelMinElems, [&](int64_t c) {
    dispatch_float(p.x_dtype, [&](auto tag) {
      using T = decltype(tag);
      QRowOut r[2];
      for (int j = 0; j < p.x_stages; ++j) r[j] = qx.out_row(c * p.x_stages + j);
      quantize_row(static_cast<const T*>(p.x) + c * p.x_stride, p.k, p.x_stages, r);
    });
  });
  return qx;
}

// x's rows as X16Row (Q8_0_R8 with x_stages 2), in the scratch of 2 stages: int16 [m, k], then f32
// [m, k / 32] scales (2 m k + m k / 8 bytes <= linear_quant_scratch_bytes(m, k, 2)).
struct QuantizedX16 {
  int16_t* q;
  float* d;
  int64_t k;
  X16Row row(int64_t c) const { return {q + c * k, d + c * (k / 32)}; }
};

QuantizedX16 quantize_x16(const LinearQuantParams& p, bool parallel = true) {
  int16_t* q = static_cast<int16_t*>(p.scratch);
  QuantizedX16 qx{q, reinterpret_cast<float*>(q + p.m * p.k), p.k};
  for_each_row(p.m, parallel && p.m * p.k >= kParallelMinElems, [&](int64_t c) {
    dispatch_float(p.x_dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* x = static_cast<const T*>(p.x) + c * p.x_stride;
      int16_t* qr = qx.q + c * p.k;
      for (int64_t u = 0; u < p.k / 32; ++u) {
        float xf[32], amax = 0.f;
        for (int i = 0; i < 32; ++i) {
          xf[i] = to_f32(x[32 * u + i]);
          const float a = __builtin_fabsf(xf[i]);
          amax = a > amax || a != a ? a : amax;  // NaN propagates, as in quantize_unit
        }
        const float d = amax / (127.f * 256.f), id = d != 0.f ? 1.f / d : 0.f;
        for (int i = 0; i < 32; ++i) qr[32 * u + i] = int16_t(__builtin_rintf(xf[i] * id));
        qx.d[c * (p.k / 32) + u] = d;
      }
    });
  });
  return qx;
}

// Q8_0_R8 with x_stages 2 reads x as int16 (the same error bound, half the integer work).
bool uses_x16(const LinearQuantParams& p) { return p.type == QuantType::kQ8_0_R8 && p.x_stages == 2; }

// ---- one weight row per format: unpack each unit, hand it to the accumulator --------------------

// The blocks of a row two at a time, pairs alternating between the accumulator slots (two FMA
// chains in flight), then a last single block: pair(slot, i) takes blocks i, i + 1; single(i) one.
template <class Pair, class Single>
KOG_QINLINE void block_pairs(int64_t nb, Pair pair, Single single) {
  int64_t i = 0;
  for (; i + 4 <= nb; i += 4) {
    pair(kSlot0, i);
    pair(kSlot1, i + 2);
  }
  if (i + 2 <= nb) pair(kSlot0, i), i += 2;
  if (i < nb) single(i);
}

template <class Acc>
KOG_QINLINE void dot_q8_0(const uint8_t* row, int64_t nb, Acc& acc) {
  const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row);
  block_pairs(
      nb,
      [&](auto slot, int64_t i) __attribute__((always_inline)) {
        acc.template pair_s8<decltype(slot)::value>(load32(b[i].qs), load32(b[i + 1].qs), i, half_to_f32(b[i].d),
                                                    half_to_f32(b[i + 1].d));
      },
      [&](int64_t i) __attribute__((always_inline)) { acc.template unit_s8<1>(load32(b[i].qs), i, half_to_f32(b[i].d)); });
}

// Q4_0 (w = d (q - 8)), Q4_1 (kMin: w = d q + m), and with kFifth Q5_0 (w = d (q - 16)) / Q5_1:
// Q4's nibbles plus the fifth bits of qh.
template <bool kMin, bool kFifth, class Block, class Acc>
KOG_QINLINE void dot_q4(const uint8_t* row, int64_t nb, Acc& acc) {
  const Block* b = reinterpret_cast<const Block*>(row);
  auto q = [&](int64_t i) __attribute__((always_inline)) {
    if constexpr (kFifth) {
      uint32_t qh;
      __builtin_memcpy(&qh, b[i].qh, 4);
      return or_bytes(nibbles16(b[i].qs), fifth_bits(qh));
    } else {
      return nibbles16(b[i].qs);
    }
  };
  auto scale = [&](int64_t i, float& a, float& m) __attribute__((always_inline)) {
    a = half_to_f32(b[i].d);
    if constexpr (kMin) {
      m = half_to_f32(b[i].m);
    } else {
      m = (kFifth ? -16.f : -8.f) * a;
    }
  };
  block_pairs(
      nb,
      [&](auto slot, int64_t i) __attribute__((always_inline)) {
        float a0, m0, a1, m1;
        scale(i, a0, m0), scale(i + 1, a1, m1);
        acc.template pair<decltype(slot)::value>(q(i), q(i + 1), i, a0, a1, m0, m1);
      },
      [&](int64_t i) __attribute__((always_inline)) {
        float a, m;
        scale(i, a, m);
        acc.template unit<1>(q(i), i, a, m);
      });
}

// Q4_K/Q5_K sub-block scales and mins as floats: a[j] = d * sc[j], b[j] = -dmin * mn[j]. The 6-bit
// packing (csrc/ops/quant.h) unpacked four sub-blocks at a time in 32-bit words (little endian).
static_assert(kCols % 2 == 0, "a row's two stages share a column group");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "k_scales reads bytes as little-endian words");
KOG_QINLINE void k_scales(const uint8_t* s, float d, float dmin, float* a, float* b) {
  uint32_t w[3];
  __builtin_memcpy(w, s, 12);
  const uint32_t sc_lo = w[0] & 0x3f3f3f3fu, mn_lo = w[1] & 0x3f3f3f3fu;
  const uint32_t sc_hi = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
  u8x8_to_f32(uint64_t(sc_lo) | uint64_t(sc_hi) << 32, d, a);
  u8x8_to_f32(uint64_t(mn_lo) | uint64_t(mn_hi) << 32, -dmin, b);
}

// Q4_K, and Q5_K (kHigh: the fifth bit of each value from qh): the same super-block layout.
template <bool kHigh, class Block, class Acc>
KOG_QINLINE void dot_k4(const uint8_t* row, int64_t nb, Acc& acc) {
  const Block* blocks = reinterpret_cast<const Block*>(row);
  for (int64_t i = 0; i < nb; ++i) {
    const Block& b = blocks[i];
    float a[8], m[8];
    k_scales(b.scales, half_to_f32(b.d), half_to_f32(b.dmin), a, m);
    wvec h{};
    if constexpr (kHigh) h = load32(b.qh);
    auto pair = [&](auto slot, int j) __attribute__((always_inline)) {
      const wvec v = load32(b.qs + 32 * j);
      wvec lo = nib_lo(v), hi = nib_hi(v);
      if constexpr (kHigh) lo = add_bit4(lo, h, 2 * j), hi = add_bit4(hi, h, 2 * j + 1);
      acc.template pair<decltype(slot)::value>(lo, hi, 8 * i + 2 * j, a[2 * j], a[2 * j + 1], m[2 * j], m[2 * j + 1]);
    };
    pair(kSlot0, 0), pair(kSlot1, 1), pair(kSlot0, 2), pair(kSlot1, 3);
  }
}

template <class Acc>
KOG_QINLINE void dot_q6_k(const uint8_t* row, int64_t nb, Acc& acc) {
  const BlockQ6_K* blocks = reinterpret_cast<const BlockQ6_K*>(row);
  for (int64_t i = 0; i < nb; ++i) {
    const BlockQ6_K& b = blocks[i];
    float a[16];  // d * scales
    s8x8_to_f32(b.scales, half_to_f32(b.d), a);
    s8x8_to_f32(b.scales + 8, half_to_f32(b.d), a + 8);
    for (int h = 0; h < 2; ++h) {
      wvec q[4];
      q6_units(b.ql + 64 * h, b.qh + 32 * h, q);
      // q - 32 per element: the -32 goes into b, with the scale of its 16-element half.
      auto unit = [&](auto slot, int t) __attribute__((always_inline)) {
        const float a0 = a[8 * h + 2 * t], a1 = a[8 * h + 2 * t + 1];
        acc.template unit_halves<decltype(slot)::value>(q[t], 8 * i + 4 * h + t, a0, a1, -32.f * a0, -32.f * a1);
      };
      unit(kSlot0, 0), unit(kSlot1, 1), unit(kSlot0, 2), unit(kSlot1, 3);
    }
  }
}

template <int NC>
void dot_row(QuantType type, const uint8_t* w, int64_t k, const QRow* x, float* out) {
  QuantAcc<NC> acc(x);
  switch (type) {
    case QuantType::kQ8_0: dot_q8_0(w, k / kQuantBlock, acc); break;
    case QuantType::kQ4_0: dot_q4<false, false, BlockQ4_0>(w, k / kQuantBlock, acc); break;
    case QuantType::kQ4_1: dot_q4<true, false, BlockQ4_1>(w, k / kQuantBlock, acc); break;
    case QuantType::kQ5_0: dot_q4<false, true, BlockQ5_0>(w, k / kQuantBlock, acc); break;
    case QuantType::kQ5_1: dot_q4<true, true, BlockQ5_1>(w, k / kQuantBlock, acc); break;
    case QuantType::kQ4_K: dot_k4<false, BlockQ4_K>(w, k / kSuperBlock, acc); break;
    case QuantType::kQ5_K: dot_k4<true, BlockQ5_K>(w, k / kSuperBlock, acc); break;
    case QuantType::kQ6_K: dot_q6_k(w, k / kSuperBlock, acc); break;
    default: break;  // packed types: quant_groups
  }
  for (int c = 0; c < NC; ++c) out[c] = acc.result(c);
}

// One group's dot for NC rows of x, by x's form (QRow: int8 stages; X16Row: Q8_0_R8's int16).
template <int NC, class Row>
KOG_QINLINE void group_dot(QuantType type, const uint8_t* group, int64_t k, const Row* x, float* out) {
  if constexpr (std::is_same_v<Row, X16Row>) {
    group_dot_r8_x16<NC>(group, k, x, out);
  } else {
    group_dot_r8<NC>(type, group, k, x, out);
  }
}

// A packed type's output rows [row_begin, row_end), both multiples of kPackRows: one group of 8
// rows at a time, x's quantized rows kR8Cols at a time (a row's stages in the same pass).
// QX: QuantizedX, or QuantizedX16 (one int16 row per row of x).
template <class QX>
void quant_groups(const LinearQuantParams& p, const QX& qx, int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  static_assert(kR8Cols % 2 == 0 || kR8Cols == 1, "a row's two stages share a pass");
  using Row = decltype(qx.row(0));
  const int stages = std::is_same_v<Row, X16Row> ? 1 : p.x_stages;
  const int64_t cols = p.m * stages;
  for (int64_t r = row_begin; r < row_end; r += kPackRows) {
    const uint8_t* group = p.weight + r * row_bytes;
    for (int64_t c0 = 0; c0 < cols; c0 += kR8Cols) {
      const int nc = int(cols - c0 < kR8Cols ? cols - c0 : kR8Cols);
      Row x[kR8Cols];
      for (int c = 0; c < nc; ++c) x[c] = qx.row(c0 + c);
      float acc[kR8Cols * kPackRows];
      switch (nc) {
        case 1: group_dot<1>(p.type, group, p.k, x, acc); break;
#if defined(__AVX512F__) || !defined(__AVX2__)
        case 2: group_dot<2>(p.type, group, p.k, x, acc); break;
        case 3: group_dot<3>(p.type, group, p.k, x, acc); break;
#endif
        default: group_dot<kR8Cols>(p.type, group, p.k, x, acc); break;
      }
      for (int j = 0; j < kPackRows; ++j) {
        const float b = p.bias != nullptr ? p.bias[r + j] : 0.f;
        if (stages == 1) {
          for (int c = 0; c < nc; ++c) p.out[(c0 + c) * p.out_stride + r + j] = acc[c * kPackRows + j] + b;
        } else {
          for (int c = 0; c < nc; c += 2)
            p.out[(c0 + c) / 2 * p.out_stride + r + j] = acc[c * kPackRows + j] + acc[(c + 1) * kPackRows + j] + b;
        }
      }
    }
  }
}

// Output rows [row_begin, row_end).
void quant_rows(const LinearQuantParams& p, const QuantizedX& qx, int64_t row_bytes, int64_t row_begin,
                int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* w = p.weight + r * row_bytes;
    // Columns are x's quantized rows (x_stages per row of x; kCols is a multiple of 2, so a
    // row's stages share a group).
    const int64_t cols = p.m * p.x_stages;
    for (int64_t c0 = 0; c0 < cols; c0 += kCols) {
      const int nc = int(cols - c0 < kCols ? cols - c0 : kCols);
      QRow x[kCols];
      for (int c = 0; c < nc; ++c) x[c] = qx.row(c0 + c);
      float acc[kCols];
      switch (nc) {
        case 1: dot_row<1>(p.type, w, p.k, x, acc); break;
        case 2: dot_row<2>(p.type, w, p.k, x, acc); break;
        case 3: dot_row<3>(p.type, w, p.k, x, acc); break;
        default: dot_row<kCols>(p.type, w, p.k, x, acc); break;
      }
      const float b = p.bias != nullptr ? p.bias[r] : 0.f;
      if (p.x_stages == 1) {
        for (int c = 0; c < nc; ++c) p.out[(c0 + c) * p.out_stride + r] = acc[c] + b;
      } else {
        for (int c = 0; c < nc; c += 2) p.out[(c0 + c) / 2 * p.out_stride + r] = acc[c] + acc[c + 1] + b;
      }
    }
  }
}

// Rows [row_begin, row_end) of any type (multiples of kPackRows for a packed one); a
// QuantizedX16 only for uses_x16.
template <class QX>
void rows_of(const LinearQuantParams& p, const QX& qx, int64_t row_bytes, int64_t row_begin, int64_t row_end) {
  if constexpr (std::is_same_v<QX, QuantizedX>) {
    if (!is_packed(p.type)) return quant_rows(p, qx, row_bytes, row_begin, row_end);
  }
  quant_groups(p, qx, row_bytes, row_begin, row_end);
}

// Bytes of one weight row (the binding has checked k against the block size; a packed type's rows
// have its file type's bytes).
int64_t row_bytes_of(const LinearQuantParams& p) {
  const QuantTypeInfo info = quant_type_info(p.type);
  return p.k / info.elems * info.bytes;
}

template <class QX>
void all_rows(const LinearQuantParams& p, const QX& qx, int64_t row_bytes) {
  constexpr int64_t kChunk = 16;  // rows per parallel work item (whole groups of a packed type)
  static_assert(kChunk % kPackRows == 0, "a work item takes whole packed groups");
  parallel_for((p.n + kChunk - 1) / kChunk, p.n * row_bytes >= kParallelMinBytes, [&](int64_t t) {
    rows_of(p, qx, row_bytes, t * kChunk, std::min(p.n, (t + 1) * kChunk));
  });
}

template <class QX>
void queued_rows(const LinearQuantParams& p, const QX& qx, int64_t row_bytes, RowQueue& queue, uint32_t epoch,
                 int part) {
  // ~16 KB of weight rows per chunk, as the float linear_part (csrc/cpu/ops/linear.cpp); whole
  // groups of a packed type, whose n is a multiple of kPackRows.
  const int64_t unit = is_packed(p.type) ? kPackRows : 1;
  const int64_t rows = std::max<int64_t>(1, (int64_t(16) << 10) / row_bytes / unit) * unit;
  queue.start(epoch, part, (p.n + rows - 1) / rows);
  for (int64_t c; (c = queue.next(epoch, part)) >= 0;)
    rows_of(p, qx, row_bytes, c * rows, std::min(p.n, (c + 1) * rows));
}

}  // namespace

void linear_quant(const LinearQuantParams& p) {
  const int64_t row_bytes = row_bytes_of(p);
  if (p.x_stages == 0) return linear_dequant(p, row_bytes);
  if (uses_x16(p)) return all_rows(p, quantize_x16(p), row_bytes);
  all_rows(p, quantize_x(p), row_bytes);
}

// NOTE: each thread quantizes all of x itself (m * k elements, a few microseconds for a decode
// row) rather than thread 0 once behind a barrier: a barrier costs more than the work, and every
// thread computes bit-identical integers, so the result does not depend on who did it.
void linear_quant_part(const LinearQuantParams& p, RowQueue& queue, uint32_t epoch, int part) {
  const int64_t row_bytes = row_bytes_of(p);
  if (uses_x16(p)) return queued_rows(p, quantize_x16(p, /*parallel=*/false), row_bytes, queue, epoch, part);
  queued_rows(p, quantize_x(p, /*parallel=*/false), row_bytes, queue, epoch, part);
}

}  // namespace kog::cpu::KOG_ISA_NS
