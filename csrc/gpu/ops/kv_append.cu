// Standalone GPU KV append (contract: csrc/ops/kv_append.h): one workgroup per token copies its
// k and v heads into the token's slot; a negative slot is padding and is skipped.
#include "gpu/compat.cuh"
#include "gpu/launch.h"

namespace kog::gpu {

namespace {

constexpr int kKvAppendThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kKvAppendThreads) kv_append_kernel(KVAppendParams p) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;
  const int64_t block = slot / p.block_size, off = slot % p.block_size;
  const T* k = static_cast<const T*>(p.k) + t * p.k_stride;
  const T* v = static_cast<const T*>(p.v) + t * p.v_stride;
  T* cache = static_cast<T*>(p.kv_cache);
  for (int64_t e = threadIdx.x; e < p.n_kv_heads * p.head_dim; e += blockDim.x) {
    const int64_t h = e / p.head_dim, d = e % p.head_dim;
    cache[((block * 2 + 0) * p.n_kv_heads + h) * p.block_size * p.head_dim + off * p.head_dim + d] = k[e];
    cache[((block * 2 + 1) * p.n_kv_heads + h) * p.block_size * p.head_dim + off * p.head_dim + d] = v[e];
  }
}

}  // namespace

void kv_append(const KVAppendParams& p, void* stream) {
  if (p.n_tokens == 0) return;
  KOG_CHECK(p.n_tokens < (int64_t(1) << 31), "kv_append: too many tokens for one launch");
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    kv_append_kernel<T><<<unsigned(p.n_tokens), kKvAppendThreads, 0, as_stream(stream)>>>(p);
    KOG_GPU_CHECK_LAUNCH();
  });
}

}  // namespace kog::gpu
