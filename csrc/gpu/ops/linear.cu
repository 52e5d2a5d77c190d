// Standalone GPU linear for decode batches (GEMV; contract: csrc/ops/linear.h), built from the
// persistent kernel's LINEAR work item (gpu/decode/linear_item.cuh). Rows of x go in groups of
// kMaxBatch, each group streaming the weight matrix once.
#include "gpu/decode/linear_item.cuh"
#include "gpu/launch.h"
#include "schedule/program.h"

namespace kog::gpu {

using decode::kThreads;

namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) linear_kernel(LinearParams p, int64_t row0) {
  const int batch = int(p.m - row0 < decode::kMaxBatch ? p.m - row0 : decode::kMaxBatch);
  const T* x = static_cast<const T*>(p.x) + row0 * p.x_stride;
  T* out = static_cast<T*>(p.out) + row0 * p.out_stride;
  const decode::NoStages<T> none;
  for (int64_t item = blockIdx.x; item < decode::linear_items(p.n); item += gridDim.x)
    decode::linear_item<T, T, 0, false>(static_cast<const T*>(p.weight), static_cast<const float*>(nullptr),
                                        static_cast<const T*>(p.bias), x, p.x_stride, out, p.out_stride, batch, p.n,
                                        p.k, item, none, 0, decode::GemvEpilogueArgs<T>{});
}

// The twin over a GPU weight format (W: Fp8E4M3, schedule::kWeightFp8, with scales [n] f32; or
// Int4Groups / Int4Q4K, gpu/decode/int4.cuh, with the format's group scales): p.weight is [n, k]
// e4m3 bytes or [n, k / 2] bytes of 4-bit codes. One instantiation per format, so the CI's ISA
// check reads each format's loads.
template <typename T, typename W>
__global__ void __launch_bounds__(kThreads) linear_quant_kernel(LinearParams p, const void* scales, int64_t row0) {
  const int batch = int(p.m - row0 < decode::kMaxBatch ? p.m - row0 : decode::kMaxBatch);
  const T* x = static_cast<const T*>(p.x) + row0 * p.x_stride;
  T* out = static_cast<T*>(p.out) + row0 * p.out_stride;
  const decode::NoStages<T> none;
  for (int64_t item = blockIdx.x; item < decode::linear_items(p.n); item += gridDim.x)
    decode::linear_item<T, T, 0, false>(static_cast<const W*>(p.weight), scales, static_cast<const T*>(p.bias), x,
                                        p.x_stride, out, p.out_stride, batch, p.n, p.k, item, none, 0,
                                        decode::GemvEpilogueArgs<T>{});
}

// Items hold kThreads / warp_size * kLinearRowsPerWarp rows; size the grid for the smallest
// (wave64) so every item has a workgroup on both warp widths.
unsigned linear_grid(int64_t n) {
  const int64_t rows_min = int64_t(kThreads / kMaxWarpSize) * decode::kLinearRowsPerWarp;
  return unsigned((n + rows_min - 1) / rows_min < 65535 ? (n + rows_min - 1) / rows_min : 65535);
}

}  // namespace

void linear(const LinearParams& p, void* stream) {
  if (p.m == 0) return;
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    KOG_CHECK(p.k % V == 0 && p.x_stride % V == 0 && aligned_to(p.weight, 16) && aligned_to(p.x, 16), "linear: the GPU ",
              "kernel needs k and the x row stride to be multiples of ", V, " elements and 16-byte aligned x and weight");
    const unsigned grid = linear_grid(p.n);
    for (int64_t r = 0; r < p.m; r += decode::kMaxBatch) {
      linear_kernel<T><<<grid, kThreads, 0, as_stream(stream)>>>(p, r);
      KOG_GPU_CHECK_LAUNCH();
    }
  });
}

void linear_fp8(const LinearParams& p, const float* scale, void* stream) {
  if (p.m == 0) return;
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    KOG_CHECK(p.k % 16 == 0 && p.x_stride % V == 0 && aligned_to(p.weight, 16) && aligned_to(p.x, 16) &&
                  aligned_to(scale, 4),
              "linear_fp8: the GPU kernel needs k a multiple of 16, the x row stride a multiple of ", V,
              " elements, 16-byte aligned x and weight and 4-byte aligned scales");
    for (int64_t r = 0; r < p.m; r += decode::kMaxBatch) {
      linear_quant_kernel<T, decode::Fp8E4M3><<<linear_grid(p.n), kThreads, 0, as_stream(stream)>>>(p, scale, r);
      KOG_GPU_CHECK_LAUNCH();
    }
  });
}

void linear_q4(const LinearParams& p, const void* groups, int32_t w_type, void* stream) {
  if (p.m == 0) return;
  const bool q4k = w_type == schedule::kWeightQ4K;
  KOG_CHECK(q4k || w_type == schedule::kWeightQ4Groups, "linear_q4: weight type ", w_type,
            " is not a 4-bit GPU format (WEIGHT_Q4_GROUPS=", schedule::kWeightQ4Groups, ", WEIGHT_Q4_K=",
            schedule::kWeightQ4K, ")");
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    KOG_CHECK(p.k % (q4k ? 256 : 32) == 0 && p.x_stride % V == 0 && aligned_to(p.weight, 16) && aligned_to(p.x, 16) &&
                  aligned_to(groups, q4k ? 16 : 4),
              "linear_q4: the GPU kernel needs k a multiple of ", q4k ? 256 : 32, ", the x row stride a multiple of ",
              V, " elements, 16-byte aligned x and weight and ", q4k ? 16 : 4, "-byte aligned scales");
    for (int64_t r = 0; r < p.m; r += decode::kMaxBatch) {
      if (q4k)
        linear_quant_kernel<T, decode::Int4Q4K><<<linear_grid(p.n), kThreads, 0, as_stream(stream)>>>(p, groups, r);
      else
        linear_quant_kernel<T, decode::Int4Groups><<<linear_grid(p.n), kThreads, 0, as_stream(stream)>>>(p, groups, r);
      KOG_GPU_CHECK_LAUNCH();
    }
  });
}

}  // namespace kog::gpu
