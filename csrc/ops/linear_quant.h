// Linear layer over GGUF-quantized weights: out = x @ W^T, W's rows kept as stored blocks
// (csrc/ops/quant.h), never dequantized to a matrix. x is quantized per 32-element block to int8
// (scale amax / 127, rounded to nearest even) and dotted with the weights' integers; the float
// scales are applied per block. Decode (m of 1..8) streams W once for all rows.
#pragma once
#include <cstdint>

#include "common/dtype.h"
#include "ops/quant.h"

namespace kog {

struct LinearQuantParams {
  float* out;             // [m, n] f32, row stride out_stride
  const void* x;          // [m, k] x_dtype, row stride x_stride
  const uint8_t* weight;  // [n, k / elems * bytes] blocks of `type` (quant_type_info), row-major
  void* scratch;          // linear_quant_scratch_bytes(m, k): x quantized (int8 [m, k]; f32 [m, k / 32]
                          // scales; f32 [m, k / 32] scale * sum of each 32; f32 [m, k / 16] of each 16)
  int64_t m;              // rows of x, >= 1
  int64_t n;              // output features (rows of W)
  int64_t k;              // input features, a multiple of type's block elements
  int64_t x_stride;       // elements between rows of x
  int64_t out_stride;     // elements between rows of out
  DType x_dtype;          // f32, f16 or bf16
  QuantType type;
};

constexpr int64_t linear_quant_scratch_bytes(int64_t m, int64_t k) {
  return m * k + 2 * m * (k / 32) * 4 + m * (k / 16) * 4;
}

}  // namespace kog
