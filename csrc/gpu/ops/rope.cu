// Host launcher of the GPU RoPE (kernel: rope.cuh).
#include <climits>

#include "gpu/launch.h"
#include "gpu/ops/rope.cuh"

namespace kog::gpu {

void rope(const RopeParams& p, void* stream) {
  const int64_t half = p.rotary_dim / 2;
  const int64_t all_pairs = (p.n_q_heads + p.n_kv_heads) * half;
  KOG_CHECK(half > 0 && half <= kRopeMaxHalf, "rope: rotary_dim ", p.rotary_dim, " exceeds ",
            2 * kRopeMaxHalf);
  KOG_CHECK(p.n_tokens <= INT_MAX && all_pairs <= INT_MAX && p.head_dim <= INT_MAX,
            "rope: shape exceeds one launch");
  const int threads = block_threads_for(all_pairs, kRopeMaxThreads);
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](const auto* positions) {
      rope_kernel<<<static_cast<unsigned>(p.n_tokens), threads, 0, as_stream(stream)>>>(
          static_cast<T*>(p.q), static_cast<T*>(p.k), positions, p.inv_freq,
          static_cast<int>(p.n_q_heads), static_cast<int>(p.n_kv_heads),
          static_cast<int>(p.head_dim), static_cast<int>(half), p.q_stride, p.k_stride,
          p.attention_scaling, p.is_neox);
    };
    if (p.pos_dtype == DType::kI64)
      launch(static_cast<const int64_t*>(p.positions));
    else
      launch(static_cast<const int32_t*>(p.positions));
    KOG_GPU_CHECK_LAUNCH();
  });
}

}  // namespace kog::gpu
