// RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.
//   without residual:  out = x / sqrt(mean(x^2) + eps) * weight
//   with residual:     residual = x + residual   (rounded to dtype, stored in place)
//                      out = residual / sqrt(mean(residual^2) + eps) * weight
// Math in fp32; one rounding to dtype per stored value. out may alias x.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace kog {

struct RMSNormParams {
  void* out;              // [n_rows, hidden] dtype, row stride out_stride
  const void* x;          // [n_rows, hidden] dtype, row stride x_stride
  void* residual;         // [n_rows, hidden] dtype, row stride residual_stride; nullptr = no fusion
  const void* weight;     // [hidden] dtype, contiguous
  int64_t n_rows;
  int64_t hidden;
  int64_t x_stride;       // elements between rows of x
  int64_t out_stride;     // elements between rows of out
  int64_t residual_stride;
  float eps;
  DType dtype;            // f32, f16 or bf16 (x, out, residual and weight alike)
};

}  // namespace kog
