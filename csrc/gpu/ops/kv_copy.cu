// Host launcher of the GPU KV block copy (kernel: kv_copy.cuh).
#include "gpu/launch.h"
#include "gpu/ops/kv_copy.cuh"

namespace kog::gpu {

namespace {

// The device-side address of a pinned host buffer (identical under unified addressing).
void* device_address(void* p, bool is_host) {
  if (!is_host || p == nullptr) return p;
  void* d = nullptr;
  KOG_GPU_CHECK(gpuHostGetDevicePointer(&d, p, 0));
  return d;
}

struct Int4Word {
  int32_t v[4];
};

}  // namespace

void copy_blocks(const kv::BlockCopyParams& p, const int32_t* pairs_device, bool dst_is_host,
                 bool src_is_host, void* stream) {
  kv::validate_block_copy(p);  // on the host copy of pairs, before anything is enqueued
  if (p.n_pairs == 0) return;
  auto* dst = static_cast<uint8_t*>(device_address(p.dst, dst_is_host));
  const auto* src = static_cast<const uint8_t*>(device_address(const_cast<void*>(p.src), src_is_host));
  const int64_t slabs = p.num_layers * p.n_pairs;
  const unsigned grid = static_cast<unsigned>(slabs < 65535 ? slabs : 65535);
  const bool wide = p.slab_bytes % 16 == 0 && aligned_to(dst, 16) && aligned_to(src, 16);
  if (wide) {
    kv_copy_blocks_kernel<Int4Word><<<grid, kKvCopyThreads, 0, as_stream(stream)>>>(
        dst, src, pairs_device, p.n_pairs, p.num_layers, p.dst_num_blocks, p.src_num_blocks,
        p.slab_bytes);
  } else {
    kv_copy_blocks_kernel<uint8_t><<<grid, kKvCopyThreads, 0, as_stream(stream)>>>(
        dst, src, pairs_device, p.n_pairs, p.num_layers, p.dst_num_blocks, p.src_num_blocks,
        p.slab_bytes);
  }
  KOG_GPU_CHECK_LAUNCH();
}

}  // namespace kog::gpu
