// FP8 e4m3 weights in the GEMV (schedule::kWeightFp8): the one-byte element type and its decode
// to f32 in registers. The encoding is the vendor's (kGpuFp8ExponentBias, gpu/vendor/*.h): OCP
// e4m3fn on NVIDIA, e4m3fnuz on AMD; the same bit manipulation decodes both.
//
// Decode: each byte's exponent and mantissa bits move into an f16 (s eeee mmm -> s 0eeee mmm0000000),
// an exact f16 of value(e4m3) * 2^(bias - 15) (normals and subnormals alike: f16 has the range),
// converted to f32. The constant 2^(15 - bias) is folded into the row's scale (fp8_row_scale),
// so a 16-byte vector costs 8 masks/shifts and 16 f16->f32 conversions, no multiply.
// NOTE: NaN codes (e4m3fn 0x7f/0xff, e4m3fnuz 0x80) decode as finite values: the loader never
// stores them (kog.fp8 rejects non-finite weights and scales).
#pragma once
#include "gpu/compat.cuh"

namespace kog::gpu::decode {

// One FP8 e4m3 weight element: its bits (the target's encoding).
struct Fp8E4M3 {
  uint8_t bits;
};

// The f32 scale a row's decoded products are multiplied by: its stored scale times 2^(15 - bias).
__device__ __forceinline__ float fp8_row_scale(float stored) {
  return stored * float(1 << (15 - kGpuFp8ExponentBias));
}

// out[j] = the e4m3 value of byte j of `word` (little endian), times 2^(bias - 15).
__device__ __forceinline__ void fp8x4_to_float(uint32_t word, float* out) {
  // Two f16 pairs: bytes (0, 2) and (1, 3), each half's sign at bit 15 and e/m at bits 7..13.
  const uint32_t even = ((word & 0x007F007Fu) << 7) | ((word & 0x00800080u) << 8);
  const uint32_t odd = (((word >> 8) & 0x007F007Fu) << 7) | (((word >> 8) & 0x00800080u) << 8);
  gpu_f16 h[4];
  __builtin_memcpy(&h[0], &even, 4);
  __builtin_memcpy(&h[2], &odd, 4);
  out[0] = gpu_to_float(h[0]), out[2] = gpu_to_float(h[1]);
  out[1] = gpu_to_float(h[2]), out[3] = gpu_to_float(h[3]);
}

}  // namespace kog::gpu::decode
