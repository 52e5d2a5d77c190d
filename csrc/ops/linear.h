// Linear layer for few rows (decode): out = x @ weight^T (+ bias), weight in HF nn.Linear layout.
// Streams the weight matrix once for all m rows, so a decode step is bound by weight bandwidth.
// Math in fp32 (fp32 accumulators), one rounding to dtype per output.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace kog {

struct LinearParams {
  void* out;            // [m, n] dtype, row stride out_stride
  const void* x;        // [m, k] dtype, row stride x_stride
  const void* weight;   // [n, k] dtype, contiguous
  const void* bias;     // [n] dtype, or nullptr
  int64_t m;            // rows of x (the batch of decode tokens), >= 1
  int64_t n;            // output features
  int64_t k;            // input features
  int64_t x_stride;
  int64_t out_stride;
  DType dtype;          // f32, f16 or bf16 for x, weight, bias and out alike
};

}  // namespace kog
