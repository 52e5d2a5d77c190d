// GGUF (ggml) quantized block formats, byte for byte as llama.cpp writes them, and their type ids.
// A quantized [n, k] matrix is n rows, each k / kElems blocks laid end to end (no padding).
// `half` fields are IEEE fp16 bit patterns. Element values (q: the stored integer):
//   Q8_0  d * q                     q int8
//   Q4_0  d * (q - 8)               q 4-bit: byte i low nibble = element i, high nibble = i + 16
//   Q4_1  d * q + m                 nibbles as Q4_0
//   Q5_0  d * (q - 16)              q 5-bit: nibbles as Q4_0, bit i of the 32-bit qh = its fifth bit
//   Q5_1  d * q + m                 q as Q5_0
//   Q4_K  d * sc[j] * q - dmin * mn[j]            j = element / 32, (sc, mn) 6-bit (k_scale_min)
//   Q5_K  as Q4_K, q = nibble + 16 * (qh bit)    5-bit
//   Q6_K  d * scales[element / 16] * (q - 32)    q 6-bit (low nibble in ql, 2 high bits in qh)
// Kog's row-interleaved forms of every type above (`_R8`, built once at load, never in a file)
// hold the same blocks with 8 rows' blocks of each 32 columns interleaved: see BlockQ4_1x8 and
// PackLayout.
#pragma once
#include <cstdint>

namespace kog {

// Values are ggml's `ggml_type` ids (GGUF tensor types), mirrored in kog/ops.py (QUANT_TYPES).
enum class QuantType : int32_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  // Row-interleaved (packed) forms, Kog's own ids (not ggml's): kPackedFlag | the base type.
  kQ4_0_R8 = 0x100 | 2,
  kQ4_1_R8 = 0x100 | 3,
  kQ5_0_R8 = 0x100 | 6,
  kQ5_1_R8 = 0x100 | 7,
  kQ8_0_R8 = 0x100 | 8,
  kQ4_K_R8 = 0x100 | 12,
  kQ5_K_R8 = 0x100 | 13,
  kQ6_K_R8 = 0x100 | 14,
};

constexpr int32_t kPackedFlag = 0x100;
constexpr int kPackRows = 8;  // rows per interleaved group

constexpr bool is_packed(QuantType t) { return (int32_t(t) & kPackedFlag) != 0; }
// The file format a packed type interleaves (a file type itself for the others).
constexpr QuantType packed_base(QuantType t) { return QuantType(int32_t(t) & ~kPackedFlag); }

using half_bits = uint16_t;  // fp16 storage

constexpr int kQuantBlock = 32;  // elements of a Q8_0/Q4_0/Q4_1 block, and of a K-quant sub-block
constexpr int kSuperBlock = 256;  // elements of a K-quant super-block

struct BlockQ8_0 {
  half_bits d;
  int8_t qs[kQuantBlock];
};
struct BlockQ4_0 {
  half_bits d;
  uint8_t qs[kQuantBlock / 2];
};
struct BlockQ4_1 {
  half_bits d;
  half_bits m;
  uint8_t qs[kQuantBlock / 2];
};
struct BlockQ5_0 {
  half_bits d;
  uint8_t qh[4];  // a little-endian 32-bit word: bit i = the fifth bit of element i
  uint8_t qs[kQuantBlock / 2];
};
struct BlockQ5_1 {
  half_bits d;
  half_bits m;
  uint8_t qh[4];
  uint8_t qs[kQuantBlock / 2];
};
// Q4_K/Q5_K: 8 sub-blocks of 32. scales[12] packs 8 6-bit scales sc[j] and 8 6-bit mins mn[j]:
// j < 4 in the low 6 bits of bytes j (sc) and j + 4 (mn); j >= 4 in the low (sc) and high (mn)
// nibble of byte j + 4, their top 2 bits in the spare top bits of bytes j - 4 (sc) and j (mn).
// qs: 4 chunks of 32 bytes; chunk c's low nibbles are sub-block 2c, its high nibbles 2c + 1.
struct BlockQ4_K {
  half_bits d;     // scale of the sub-block scales
  half_bits dmin;  // scale of the sub-block mins
  uint8_t scales[12];
  uint8_t qs[kSuperBlock / 2];
};
// qh[l] bit s is the fifth bit of element 32 * s + l.
struct BlockQ5_K {
  half_bits d;
  half_bits dmin;
  uint8_t scales[12];
  uint8_t qh[kSuperBlock / 8];
  uint8_t qs[kSuperBlock / 2];
};
// Two halves of 128 elements (h = 0, 1). Element 128 h + 32 t + l (t < 4, l < 32): low 4 bits
// (ql[64 h + 32 (t % 2) + l] >> 4 (t / 2)) & 15, high 2 bits (qh[32 h + l] >> 2 t) & 3.
struct BlockQ6_K {
  uint8_t ql[kSuperBlock / 2];
  uint8_t qh[kSuperBlock / 4];
  int8_t scales[kSuperBlock / 16];  // one per 16 elements
  half_bits d;
};

// A packed [n, k] matrix (n a multiple of kPackRows): group g holds rows 8 g .. 8 g + 7 in the
// bytes of those 8 rows (8 row_bytes from 8 g row_bytes), as k / 32 units; unit u interleaves the
// 8 rows' block u: each header field as 8 consecutive halves (row r at index r), then the quants
// in chunks of 32 bytes, chunk c = 4 bytes of each row in turn (row r at 4 r): row r's bytes
// qs[4 c .. 4 c + 3]. So a row's Q4 chunk c holds elements 4c..4c+3 (low nibbles) and 16+4c..
// (high nibbles), and one 32-byte load of a chunk is 8 rows' 4-element groups, which a 4-byte
// group of x broadcast to every row dots in one instruction. Same bytes as the 8 rows.
struct BlockQ4_0x8 {
  half_bits d[kPackRows];
  uint8_t qs[kPackRows * kQuantBlock / 2];  // 4 chunks
};
struct BlockQ4_1x8 {
  half_bits d[kPackRows];
  half_bits m[kPackRows];
  uint8_t qs[kPackRows * kQuantBlock / 2];  // 4 chunks
};
// Q5: chunk 0 holds the 8 rows' qh words (row r at 4 r), chunks 1-4 their qs as Q4's chunks 0-3.
struct BlockQ5_0x8 {
  half_bits d[kPackRows];
  uint8_t qh[kPackRows * 4];                // 1 chunk
  uint8_t qs[kPackRows * kQuantBlock / 2];  // 4 chunks
};
struct BlockQ5_1x8 {
  half_bits d[kPackRows];
  half_bits m[kPackRows];
  uint8_t qh[kPackRows * 4];
  uint8_t qs[kPackRows * kQuantBlock / 2];
};
struct BlockQ8_0x8 {
  half_bits d[kPackRows];
  int8_t qs[kPackRows * kQuantBlock];  // 8 chunks
};
// A Q4_K super-block of 8 rows: the 12 scale bytes are 3 chunks (chunk s: row r's scales[4 s ..
// 4 s + 3], i.e. its 32-bit word s of k_scale_min), then 32 chunks of qs: chunk 8 c + g holds row
// r's qs[32 c + 4 g .. + 3] = elements 4g..4g+3 of sub-block 2c (low nibbles) and 2c + 1 (high).
struct BlockQ4_Kx8 {
  half_bits d[kPackRows];
  half_bits dmin[kPackRows];
  uint8_t scales[kPackRows * 12];           // 3 chunks
  uint8_t qs[kPackRows * kSuperBlock / 2];  // 32 chunks
};

// A Q5_K super-block of 8 rows: BlockQ4_Kx8's fields, with the 32 qh bytes as 8 chunks between
// the scales and qs: chunk g holds row r's qh[4 g .. 4 g + 3], the fifth bits (bit j: sub-block
// j) of the elements that qs chunk 8 c + g holds.
struct BlockQ5_Kx8 {
  half_bits d[kPackRows];
  half_bits dmin[kPackRows];
  uint8_t scales[kPackRows * 12];           // 3 chunks
  uint8_t qh[kPackRows * kSuperBlock / 8];  // 8 chunks
  uint8_t qs[kPackRows * kSuperBlock / 2];  // 32 chunks
};
// A Q6_K super-block of 8 rows: the chunks first, as in the file (ql: 32 chunks, chunk c = row r's
// ql[4 c .. 4 c + 3]; qh: 16 chunks; scales: 4 chunks), then d as 8 halves (the file's trailing
// header).
struct BlockQ6_Kx8 {
  uint8_t ql[kPackRows * kSuperBlock / 2];
  uint8_t qh[kPackRows * kSuperBlock / 4];
  int8_t scales[kPackRows * kSuperBlock / 16];
  half_bits d[kPackRows];
};

static_assert(sizeof(BlockQ8_0) == 34, "ggml block_q8_0");
static_assert(sizeof(BlockQ5_0) == 22, "ggml block_q5_0");
static_assert(sizeof(BlockQ5_1) == 24, "ggml block_q5_1");
static_assert(sizeof(BlockQ4_0) == 18, "ggml block_q4_0");
static_assert(sizeof(BlockQ4_1) == 20, "ggml block_q4_1");
static_assert(sizeof(BlockQ4_K) == 144, "ggml block_q4_K");
static_assert(sizeof(BlockQ5_K) == 176, "ggml block_q5_K");
static_assert(sizeof(BlockQ6_K) == 210, "ggml block_q6_K");
static_assert(sizeof(BlockQ4_0x8) == kPackRows * sizeof(BlockQ4_0), "packed Q4_0: the rows' bytes");
static_assert(sizeof(BlockQ4_1x8) == kPackRows * sizeof(BlockQ4_1), "packed Q4_1: the rows' bytes");
static_assert(sizeof(BlockQ5_0x8) == kPackRows * sizeof(BlockQ5_0), "packed Q5_0: the rows' bytes");
static_assert(sizeof(BlockQ5_1x8) == kPackRows * sizeof(BlockQ5_1), "packed Q5_1: the rows' bytes");
static_assert(sizeof(BlockQ8_0x8) == kPackRows * sizeof(BlockQ8_0), "packed Q8_0: the rows' bytes");
static_assert(sizeof(BlockQ4_Kx8) == kPackRows * sizeof(BlockQ4_K), "packed Q4_K: the rows' bytes");
static_assert(sizeof(BlockQ5_Kx8) == kPackRows * sizeof(BlockQ5_K), "packed Q5_K: the rows' bytes");
static_assert(sizeof(BlockQ6_Kx8) == kPackRows * sizeof(BlockQ6_K), "packed Q6_K: the rows' bytes");

// How a packed type interleaves its base's blocks: `front` fp16 fields lead the block, `back` ones
// end it (Q6_K's d), every other byte is in 4-byte chunks. In the packed unit: each front field
// as 8 halves (row r at index r), the chunks (chunk c = 4 bytes of each row in turn), then each
// back field as 8 halves. kog.quantized packs and unpacks by it (through _C.packed_quant_types).
// static: each translation unit (each CPU ISA build among them) keeps its own copy.
struct PackLayout {
  int front;
  int back;
};
static constexpr PackLayout pack_layout(QuantType packed) {
  switch (packed_base(packed)) {
    case QuantType::kQ4_1:
    case QuantType::kQ5_1:
    case QuantType::kQ4_K:
    case QuantType::kQ5_K: return {2, 0};
    case QuantType::kQ6_K: return {0, 1};
    default: return {1, 0};  // Q4_0, Q5_0, Q8_0: d
  }
}

struct QuantTypeInfo {
  const char* name;
  int32_t elems;  // elements per block
  int32_t bytes;  // bytes per block
};

// A nullptr name: a type this build does not support. static: each translation unit (each CPU
// ISA build among them) keeps its own copy, so no AVX-512 build of it can be linked into the
// generic path (cmake/KogCpuIsa.cmake).
static constexpr QuantTypeInfo quant_type_info(QuantType t) {
  switch (t) {
    case QuantType::kQ4_0: return {"Q4_0", kQuantBlock, int32_t(sizeof(BlockQ4_0))};
    case QuantType::kQ4_1: return {"Q4_1", kQuantBlock, int32_t(sizeof(BlockQ4_1))};
    case QuantType::kQ5_0: return {"Q5_0", kQuantBlock, int32_t(sizeof(BlockQ5_0))};
    case QuantType::kQ5_1: return {"Q5_1", kQuantBlock, int32_t(sizeof(BlockQ5_1))};
    case QuantType::kQ8_0: return {"Q8_0", kQuantBlock, int32_t(sizeof(BlockQ8_0))};
    case QuantType::kQ4_K: return {"Q4_K", kSuperBlock, int32_t(sizeof(BlockQ4_K))};
    case QuantType::kQ5_K: return {"Q5_K", kSuperBlock, int32_t(sizeof(BlockQ5_K))};
    case QuantType::kQ6_K: return {"Q6_K", kSuperBlock, int32_t(sizeof(BlockQ6_K))};
    // Per row, a packed type has its base's block size (a unit of 8 rows is 8 blocks).
    case QuantType::kQ4_0_R8: return {"Q4_0_R8", kQuantBlock, int32_t(sizeof(BlockQ4_0))};
    case QuantType::kQ4_1_R8: return {"Q4_1_R8", kQuantBlock, int32_t(sizeof(BlockQ4_1))};
    case QuantType::kQ5_0_R8: return {"Q5_0_R8", kQuantBlock, int32_t(sizeof(BlockQ5_0))};
    case QuantType::kQ5_1_R8: return {"Q5_1_R8", kQuantBlock, int32_t(sizeof(BlockQ5_1))};
    case QuantType::kQ8_0_R8: return {"Q8_0_R8", kQuantBlock, int32_t(sizeof(BlockQ8_0))};
    case QuantType::kQ4_K_R8: return {"Q4_K_R8", kSuperBlock, int32_t(sizeof(BlockQ4_K))};
    case QuantType::kQ5_K_R8: return {"Q5_K_R8", kSuperBlock, int32_t(sizeof(BlockQ5_K))};
    case QuantType::kQ6_K_R8: return {"Q6_K_R8", kSuperBlock, int32_t(sizeof(BlockQ6_K))};
  }
  return {nullptr, 0, 0};
}

constexpr QuantType kQuantTypes[] = {QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ5_0, QuantType::kQ5_1,
                                     QuantType::kQ8_0, QuantType::kQ4_K, QuantType::kQ5_K, QuantType::kQ6_K};
constexpr QuantType kPackedQuantTypes[] = {QuantType::kQ4_0_R8, QuantType::kQ4_1_R8, QuantType::kQ5_0_R8,
                                           QuantType::kQ5_1_R8, QuantType::kQ8_0_R8, QuantType::kQ4_K_R8,
                                           QuantType::kQ5_K_R8, QuantType::kQ6_K_R8};

}  // namespace kog
