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
  void* scratch;          // linear_quant_scratch_bytes(m, k, x_stages): x quantized, M = m * x_stages rows
                          // (int8 [M, k]; f32 [M, k / 32] scales; f32 [M, k / 32] scale * sum of each 32;
                          // f32 [M, k / 16] of each 16)
  int64_t m;              // rows of x, >= 1
  int64_t n;              // output features (rows of W)
  int64_t k;              // input features, a multiple of type's block elements
  int64_t x_stride;       // elements between rows of x
  int64_t out_stride;     // elements between rows of out
  DType x_dtype;          // f32, f16 or bf16
  QuantType type;
  const float* bias = nullptr;  // [n] f32 added to every row of out, or null
  // 1: x quantized once per unit (error <= amax / 254 per element). 2: also its residual
  // x - d q, quantized again and dotted too (error <= amax / 64516: near fp32 logits for about
  // twice the integer work and the same weight bytes; the model program's LINEARs use it).
  // 0: x stays f32 (x_dtype must be f32): weight rows are dequantized a tile at a time into
  // the thread's cache and multiplied in f32, exact products (the prefill of a short prompt;
  // linear_quant only, not linear_quant_part).
  int x_stages = 1;
};

// One row of blocks dequantized: out[0, k) = the row's values in f32, exactly as
// gguf.quants.dequantize computes them (csrc/ops/quant.h gives each format's formula).
struct DequantizeRowsParams {
  float* out;             // [n_ids, k] f32, row stride k
  const uint8_t* weight;  // [rows, k / elems * bytes] blocks of `type`
  const int64_t* ids;     // [n_ids] rows of weight to dequantize (each in [0, rows)), or null: rows 0..n_ids-1
  int64_t n_ids;
  int64_t k;              // elements per row, a multiple of type's block elements
  QuantType type;
};

// Scratch for m rows of x quantized in `stages` stages: 1.5 m k stages bytes.
constexpr int64_t linear_quant_scratch_bytes(int64_t m, int64_t k, int64_t stages = 1) {
  return stages * (m * k + 2 * m * (k / 32) * 4 + m * (k / 16) * 4);
}

}  // namespace kog
