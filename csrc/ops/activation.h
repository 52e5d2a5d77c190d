// SiLU-and-mul (SwiGLU gate): out = silu(x[:, :d]) * x[:, d:], silu(g) = g / (1 + exp(-g)).
// Math in fp32, one rounding to dtype.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace kog {

struct SiluAndMulParams {
  void* out;        // [n_rows, d] dtype, row stride out_stride
  const void* x;    // [n_rows, 2 * d] dtype (gate half then up half), row stride x_stride
  int64_t n_rows;
  int64_t d;
  int64_t x_stride;
  int64_t out_stride;
  DType dtype;      // f32, f16 or bf16
};

}  // namespace kog
