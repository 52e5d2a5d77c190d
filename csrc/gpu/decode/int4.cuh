// 4-bit weights in the GEMV (schedule::kWeightQ4Groups, schedule::kWeightQ4K): the element tags,
// each group's affine (scale, min) from Op::w_scale, and the decode of codes to f32 in registers.
//
// Layout (both formats; kog.int4 writes it): a row of k elements is k / 32 groups of 16 bytes;
// byte j of a group holds element j (low nibble) and element j + 16 (high nibble), as GGUF's
// Q4_0 / Q4_1 blocks do. Element e of a group is scale * q_e + min with
//   kWeightQ4Groups: (scale, min) the group's f16 pair, w_scale [rows, k / 32] (4 bytes each);
//   kWeightQ4K:      the 16-byte Q4_K header of the group's super-block (f16 d, f16 dmin, 12
//                    bytes of 6-bit scales / mins), w_scale [rows, k / 256]: group j of the
//                    super-block has scale d * sc_j and min -dmin * m_j (GGUF's get_scale_min_k4).
// So one 16-byte weight vector is one group: one affine per 32 elements, loaded beside it.
//
// Decode: each code becomes an exact f32 by one byte move into a float's mantissa (or AMD's
// byte conversion; gpu_byte_to_float, gpu/vendor/*.h), then fma(q, scale, min): the exact value
// of scale * q + min rounded once, as kog.int4's CPU reference computes it.
#pragma once
#include "gpu/compat.cuh"

namespace kog::gpu::decode {

// Element tags of the two 4-bit formats: sizeof 1 so that a 16-byte vector type exists (WVec);
// its 16 bytes hold 32 elements (kWeightElems16).
struct Int4Groups {
  uint8_t bits;
};
struct Int4Q4K {
  uint8_t bits;
};

template <typename W>
constexpr bool kInt4Weights = std::is_same<W, Int4Groups>::value || std::is_same<W, Int4Q4K>::value;

// Elements of one 16-byte weight vector of W: 32 for the 4-bit formats, else 16 / sizeof(W).
template <typename W>
constexpr int kWeightElems16 = kInt4Weights<W> ? 32 : kVec16<W>;

// One group's affine map from codes to values.
struct GroupAffine {
  float scale = 1.f;
  float min = 0.f;
};

// The affine of group c of a row; groups: the row's part of Op::w_scale (kWeightQ4Groups: its
// k / 32 f16 pairs; kWeightQ4K: its k / 256 16-byte headers, 16-byte aligned). Other weight
// types: the identity, read from nowhere (decode_weights ignores it).
template <typename W>
__device__ __forceinline__ GroupAffine group_affine(const void* __restrict__ groups, int64_t c) {
  GroupAffine g;
  if constexpr (std::is_same<W, Int4Groups>::value) {
    const uint32_t pair = static_cast<const uint32_t*>(groups)[c];
    gpu_f16 h[2];
    __builtin_memcpy(h, &pair, 4);
    g.scale = gpu_to_float(h[0]), g.min = gpu_to_float(h[1]);
  } else if constexpr (std::is_same<W, Int4Q4K>::value) {
    // The 8 groups of a super-block read the same header: one 16-byte load, shared by lanes.
    const Vec<uint32_t, 4> hv = load16(static_cast<const Vec<uint32_t, 4>*>(groups) + c / 8);
    gpu_f16 h[2];
    __builtin_memcpy(h, &hv.v[0], 4);
    // Scale bytes q[0..7] as one 64-bit value, q[8..11] as one word: shifts by the group's index
    // instead of indexing registers at run time (which would go through local memory).
    const uint64_t lo = (uint64_t(hv.v[2]) << 32) | hv.v[1];
    const uint32_t hi = hv.v[3];
    const int j = int(c % 8);
    uint32_t sc, mn;
    if (j < 4) {
      sc = uint32_t(lo >> (8 * j)) & 63u;
      mn = uint32_t(lo >> (8 * (j + 4))) & 63u;
    } else {
      const uint32_t qj4 = (hi >> (8 * (j - 4))) & 0xFFu;  // q[j + 4]
      sc = (qj4 & 0xFu) | ((uint32_t(lo >> (8 * (j - 4))) & 0xFFu) >> 6 << 4);
      mn = (qj4 >> 4) | ((uint32_t(lo >> (8 * j)) & 0xFFu) >> 6 << 4);
    }
    g.scale = gpu_to_float(h[0]) * float(sc), g.min = -(gpu_to_float(h[1]) * float(mn));
  }
  return g;
}

// wf = elements [r * V, (r + 1) * V) of one 16-byte 4-bit vector (words: its 4 words), scaled:
// fma(q, scale, min). V divides 16 (one x vector never straddles the low and high nibbles).
template <int V>
__device__ __forceinline__ void int4_decode(const uint32_t (&words)[4], int r, GroupAffine g, float (&wf)[V]) {
  static_assert(16 % V == 0 && V % 4 == 0, "an x vector covers whole words of one nibble half");
  const int e0 = r * V, half = e0 / 16, byte0 = e0 % 16;
#pragma unroll
  for (int q = 0; q < V / 4; ++q) {
    const uint32_t w = words[byte0 / 4 + q];
    const uint32_t codes = (half ? w >> 4 : w) & 0x0F0F0F0Fu;
#pragma unroll
    for (int b = 0; b < 4; ++b) wf[4 * q + b] = fmaf(gpu_byte_to_float(codes, b), g.scale, g.min);
  }
}

}  // namespace kog::gpu::decode
