// Standalone on-device sampling (gpu/decode/sample_item.cuh): one workgroup per row of f32
// logits; greedy rows (temperature <= 0) take the argmax.
#include "gpu/decode/sample_item.cuh"
#include "gpu/launch.h"

namespace kog::gpu {

using decode::kThreads;

namespace {

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* logits, int64_t vocab,
                                                          const decode::SamplingRow* rows, uint64_t counter,
                                                          int32_t* out) {
  __shared__ float smem[decode::kSampleSmemFloats];
  const int64_t b = blockIdx.x;
  const int token = decode::sample_row(logits + b * vocab, int(vocab), rows[b], counter, smem);
  if (threadIdx.x == 0) out[b] = token;
}

}  // namespace

void sample(const float* logits, int64_t n_rows, int64_t vocab, const void* rows, uint64_t counter, int32_t* out,
            void* stream) {
  KOG_CHECK(n_rows >= 0 && n_rows < (int64_t(1) << 31) && vocab > 0 && vocab < (int64_t(1) << 31),
            "sample: bad shape [", n_rows, ", ", vocab, "]");
  if (n_rows == 0) return;
  sample_kernel<<<unsigned(n_rows), kThreads, 0, as_stream(stream)>>>(
      logits, vocab, static_cast<const decode::SamplingRow*>(rows), counter, out);
  KOG_GPU_CHECK_LAUNCH();
}

}  // namespace kog::gpu
