// Standalone GPU linear for decode batches (GEMV; contract: csrc/ops/linear.h), built from the
// persistent kernel's LINEAR work item (gpu/decode/linear_item.cuh). Rows of x go in groups of
// kMaxBatch, each group streaming the weight matrix once.
#include "gpu/decode/linear_item.cuh"
#include "gpu/launch.h"

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
    decode::linear_item<T, T, 0, false>(static_cast<const T*>(p.weight), static_cast<const T*>(p.bias), x, p.x_stride, out,
                                 p.out_stride, batch, p.n, p.k, item, none, 0, decode::GemvEpilogueArgs<T>{});
}

}  // namespace

void linear(const LinearParams& p, void* stream) {
  if (p.m == 0) return;
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    KOG_CHECK(p.k % V == 0 && p.x_stride % V == 0 && aligned_to(p.weight, 16) && aligned_to(p.x, 16), "linear: the GPU ",
              "kernel needs k and the x row stride to be multiples of ", V, " elements and 16-byte aligned x and weight");
    // Items hold kThreads / warp_size * kLinearRowsPerWarp rows; size the grid for the smallest
    // (wave64) so every item has a workgroup on both warp widths.
    const int64_t rows_min = int64_t(kThreads / kMaxWarpSize) * decode::kLinearRowsPerWarp;
    const unsigned grid = unsigned((p.n + rows_min - 1) / rows_min < 65535 ? (p.n + rows_min - 1) / rows_min : 65535);
    for (int64_t r = 0; r < p.m; r += decode::kMaxBatch) {
      linear_kernel<T><<<grid, kThreads, 0, as_stream(stream)>>>(p, r);
      KOG_GPU_CHECK_LAUNCH();
    }
  });
}

}  // namespace kog::gpu
