// Rows of GGUF blocks to f32 (the quantized EMBED and the prefill's weight tiles). Contract:
// csrc/ops/linear_quant.h (DequantizeRowsParams); formats: csrc/ops/quant.h. Plain loops: one
// row is a few KB, and a prefill dequantizes each tile once for hundreds of tokens.
#include "cpu/kernels.h"
#include "cpu/ops/quant_dot.h"

#include <vector>

namespace kog::cpu::KOG_ISA_NS {
namespace {

// Values multiply in the order gguf.quants does ((d * scale) * q - (dmin * min)), so the result
// matches its reference to the rounding of a contracted multiply-add.
void row_q8_0(const uint8_t* row, int64_t nb, float* y) {
  const BlockQ8_0* b = reinterpret_cast<const BlockQ8_0*>(row);
  for (int64_t i = 0; i < nb; ++i, y += kQuantBlock) {
    const float d = half_to_f32(b[i].d);
    for (int l = 0; l < kQuantBlock; ++l) y[l] = d * float(b[i].qs[l]);
  }
}

// Q4_0 (w = d (q - 8)), Q4_1 (kMin: w = d q + m), and with kFifth Q5_0 (w = d (q - 16)) / Q5_1
// (w = d q + m), q = nibble + 16 * bit i of qh for element i.
template <bool kMin, bool kFifth, class Block>
void row_q4(const uint8_t* row, int64_t nb, float* y) {
  const Block* b = reinterpret_cast<const Block*>(row);
  constexpr int kOffset = kFifth ? 16 : 8;
  for (int64_t i = 0; i < nb; ++i, y += kQuantBlock) {
    const float d = half_to_f32(b[i].d);
    uint32_t qh = 0;
    if constexpr (kFifth) __builtin_memcpy(&qh, b[i].qh, 4);
    for (int l = 0; l < kQuantBlock / 2; ++l) {
      const int lo = (b[i].qs[l] & 15) | int((qh >> l) & 1) << 4;
      const int hi = (b[i].qs[l] >> 4) | int((qh >> (l + 16)) & 1) << 4;
      if constexpr (kMin) {
        const float m = half_to_f32(b[i].m);
        y[l] = d * float(lo) + m;
        y[l + 16] = d * float(hi) + m;
      } else {
        y[l] = d * float(lo - kOffset);
        y[l + 16] = d * float(hi - kOffset);
      }
    }
  }
}

// Scale and min of sub-block j of a Q4_K/Q5_K super-block (the 6-bit packing of quant.h).
void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63, mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <bool kHigh, class Block>
void row_k4(const uint8_t* row, int64_t nb, float* y) {
  const Block* blocks = reinterpret_cast<const Block*>(row);
  for (int64_t i = 0; i < nb; ++i) {
    const Block& b = blocks[i];
    const float d = half_to_f32(b.d), dmin = half_to_f32(b.dmin);
    for (int j = 0; j < 8; ++j, y += kQuantBlock) {
      int sc, mn;
      scale_min_k4(j, b.scales, sc, mn);
      const float a = d * float(sc), m = dmin * float(mn);
      const uint8_t* qs = b.qs + 32 * (j / 2);
      for (int l = 0; l < kQuantBlock; ++l) {
        int q = (qs[l] >> (4 * (j % 2))) & 15;
        if constexpr (kHigh) q += ((reinterpret_cast<const BlockQ5_K&>(b).qh[l] >> j) & 1) << 4;
        y[l] = a * float(q) - m;
      }
    }
  }
}

void row_q6_k(const uint8_t* row, int64_t nb, float* y) {
  const BlockQ6_K* blocks = reinterpret_cast<const BlockQ6_K*>(row);
  for (int64_t i = 0; i < nb; ++i, y += kSuperBlock) {
    const BlockQ6_K& b = blocks[i];
    const float d = half_to_f32(b.d);
    for (int e = 0; e < kSuperBlock; ++e) {
      const int h = e / 128, t = (e % 128) / 32, l = e % 32;
      const int lo = (b.ql[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15;
      const int hi = (b.qh[32 * h + l] >> (2 * t)) & 3;
      y[e] = (d * float(b.scales[e / 16])) * float((lo | hi << 4) - 32);
    }
  }
}


}  // namespace

const uint8_t* plain_row(QuantType type, const uint8_t* w, int64_t r, int64_t row_bytes, uint8_t* buf) {
  if (!is_packed(type)) return w + r * row_bytes;
  // The half fields around the 4-byte chunks, and a block's bytes (quant.h: PackLayout).
  const PackLayout lay = pack_layout(type);
  const int64_t block = quant_type_info(type).bytes;
  const int chunks = (int(block) - 2 * (lay.front + lay.back)) / 4;
  const int64_t nb = row_bytes / block, lane = r % kPackRows;
  const uint8_t* group = w + (r - lane) * row_bytes;
  for (int64_t u = 0; u < nb; ++u) {
    const uint8_t* unit = group + u * kPackRows * block;
    uint8_t* out = buf + u * block;
    for (int h = 0; h < lay.front; ++h) __builtin_memcpy(out + 2 * h, unit + 2 * kPackRows * h + 2 * lane, 2);
    const uint8_t* in_chunks = unit + 2 * kPackRows * lay.front;
    uint8_t* out_chunks = out + 2 * lay.front;
    for (int c = 0; c < chunks; ++c)
      __builtin_memcpy(out_chunks + 4 * c, in_chunks + 4 * kPackRows * c + 4 * lane, 4);
    const uint8_t* in_back = in_chunks + 4 * kPackRows * chunks;
    for (int h = 0; h < lay.back; ++h)
      __builtin_memcpy(out_chunks + 4 * chunks + 2 * h, in_back + 2 * kPackRows * h + 2 * lane, 2);
  }
  return buf;
}

void dequantize_row(QuantType type, const uint8_t* w, int64_t k, float* y) {
  const int64_t nb = k / quant_type_info(type).elems;
  switch (type) {
    default: break;  // packed types: plain_row first
    case QuantType::kQ8_0: row_q8_0(w, nb, y); break;
    case QuantType::kQ4_0: row_q4<false, false, BlockQ4_0>(w, nb, y); break;
    case QuantType::kQ4_1: row_q4<true, false, BlockQ4_1>(w, nb, y); break;
    case QuantType::kQ5_0: row_q4<false, true, BlockQ5_0>(w, nb, y); break;
    case QuantType::kQ5_1: row_q4<true, true, BlockQ5_1>(w, nb, y); break;
    case QuantType::kQ4_K: row_k4<false, BlockQ4_K>(w, nb, y); break;
    case QuantType::kQ5_K: row_k4<true, BlockQ5_K>(w, nb, y); break;
    case QuantType::kQ6_K: row_q6_k(w, nb, y); break;
  }
}

void dequantize_rows(const DequantizeRowsParams& p) {
  const QuantTypeInfo info = quant_type_info(p.type);
  const int64_t row_bytes = p.k / info.elems * info.bytes;
  for_each_row(p.n_ids, p.n_ids * p.k >= kParallelMinElems, [&](int64_t r) {
    thread_local std::vector<uint8_t> buf;
    buf.resize(size_t(row_bytes));
    const uint8_t* row = plain_row(p.type, p.weight, p.ids != nullptr ? p.ids[r] : r, row_bytes, buf.data());
    dequantize_row(packed_base(p.type), row, p.k, p.out + r * p.k);
  });
}

}  // namespace kog::cpu::KOG_ISA_NS
