// Host-side interface of the GPU backend: plain C++, no vendor types, so the bindings compile
// the same in every build. Implemented by csrc/gpu/**/*.cu in cuda and rocm builds only.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/kv_copy.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/kv_append.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace kog::gpu {

struct DeviceInfo {
  int index;
  std::string name;
  std::string arch;       // "sm_90" / "gfx942"
  int64_t total_memory;   // bytes
  int multiprocessors;    // SMs or CUs
  int warp_size;          // 32 or 64
  int64_t shared_memory_per_block;
};

// Devices the runtime sees; empty when no driver or device is present (never throws).
std::vector<DeviceInfo> devices();
// "CUDA 13.0" / "HIP 6.2": the runtime this module was built against.
std::string runtime_version();

// Launchers: enqueue on `stream` (cudaStream_t / hipStream_t as an opaque pointer) on the
// current device. Throw kog::Error(kBackend) if the launch fails.
void rmsnorm(const RMSNormParams& p, void* stream);
void rope(const RopeParams& p, void* stream);
void silu_and_mul(const SiluAndMulParams& p, void* stream);
// Decode-batch GEMV: k and x's row stride multiples of 16 bytes, x and weight 16-byte aligned.
void linear(const LinearParams& p, void* stream);
// The same over FP8 e4m3 weights (schedule::kWeightFp8, the target's encoding): p.weight is
// [n, k] bytes, scale [n] f32, out[b, r] = scale[r] * (x[b] . e4m3(w[r])) + bias[r]; k % 16 == 0.
void linear_fp8(const LinearParams& p, const float* scale, void* stream);
// The same over 4-bit weights (schedule::kWeightQ4Groups or kWeightQ4K, `w_type`): p.weight is
// [n, k / 2] bytes of codes, groups the format's scales (gpu/decode/int4.cuh); k % 32 == 0
// (Q4_K: k % 256 == 0, headers 16-byte aligned).
void linear_q4(const LinearParams& p, const void* groups, int32_t w_type, void* stream);
void kv_append(const KVAppendParams& p, void* stream);
// Paged attention, decode (p.query_start_loc null) or causal prefill. partials: device scratch
// of gpu_attention_partials_floats (ops/attention.h) floats (none when the launch takes the flash
// prefill kernel; `kernel` as given there). Metadata arrays are device memory.
void paged_attention(const PagedAttentionParams& p, float* partials, void* stream,
                     GpuPrefillKernel kernel = GpuPrefillKernel::kAuto);
// Flash-style causal prefill (gpu/ops/prefill_attention.cuh), what paged_attention runs for
// chunks of at least kGpuFlashPrefillMinQueryLen tokens: needs p.query_start_loc and a 16-byte
// aligned cache (prefill_attention_supported); no scratch.
bool prefill_attention_supported(const PagedAttentionParams& p);
void prefill_attention(const PagedAttentionParams& p, void* stream);
// Samples one token per row of f32 logits [n_rows, vocab]; rows: [n_rows] SamplingRow
// (gpu/decode/params.h) in device memory; counter: the draw counter; out: [n_rows] int32.
void sample(const float* logits, int64_t n_rows, int64_t vocab, const void* rows, uint64_t counter, int32_t* out,
            void* stream);
// KV slab copies (CoW, swap) on `stream`; p.pairs is the host copy (validated here),
// pairs_device the same [n_pairs, 2] on the device; a *_is_host pool is pinned host memory.
void copy_blocks(const kv::BlockCopyParams& p, const int32_t* pairs_device, bool dst_is_host,
                 bool src_is_host, void* stream);

}  // namespace kog::gpu
