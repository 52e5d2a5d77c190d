// NVIDIA side of the vendor-neutral GPU API (the HIP twin is hip.h; only these two files and
// compat.cuh know which vendor is compiling). Names follow the CUDA runtime with a `gpu`
// prefix so kernel code reads like CUDA.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#define KOG_GPU_VENDOR "CUDA"

using gpuError_t = cudaError_t;
using gpuStream_t = cudaStream_t;
using gpuDeviceProp_t = cudaDeviceProp;

constexpr gpuError_t gpuSuccess = cudaSuccess;

#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuGetDeviceProperties cudaGetDeviceProperties
#define gpuGetDevice cudaGetDevice
#define gpuSetDevice cudaSetDevice
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuHostGetDevicePointer cudaHostGetDevicePointer
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuFuncGetAttributes cudaFuncGetAttributes
#define gpuFuncAttributes cudaFuncAttributes
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMemsetAsync cudaMemsetAsync
#define gpuLaunchCooperativeKernel cudaLaunchCooperativeKernel
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuFuncSetAttribute cudaFuncSetAttribute
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define gpuHostAlloc cudaHostAlloc
#define gpuHostAllocMapped cudaHostAllocMapped
#define gpuFreeHost cudaFreeHost
using gpuIpcMemHandle_t = cudaIpcMemHandle_t;
#define gpuIpcGetMemHandle cudaIpcGetMemHandle
#define gpuIpcOpenMemHandle cudaIpcOpenMemHandle
#define gpuIpcCloseMemHandle cudaIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess cudaIpcMemLazyEnablePeerAccess

// Device memory another device's kernel stores into and this device's kernel polls at system
// scope (the tensor-parallel flags, gpu/decode/rank_items.cuh): cudaMalloc's memory is, with
// .sys loads and stores, over NVLink and PCIe peers alike.
inline gpuError_t gpu_malloc_signals(void** p, size_t bytes) { return cudaMalloc(p, bytes); }

// Ticks of gpu_wall_ticks per millisecond on `device`: %globaltimer counts nanoseconds.
inline int64_t gpu_wall_ticks_per_ms(int /*device*/) { return 1000000; }

// The device's wall clock (for bounded spin waits), and a trap that kills the launch.
__device__ __forceinline__ uint64_t gpu_wall_ticks() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void gpu_trap() { __trap(); }

// Runtime the module was compiled against, e.g. "CUDA 13.0".
inline std::string gpu_runtime_version() {
  return "CUDA " + std::to_string(CUDART_VERSION / 1000) + "." +
         std::to_string(CUDART_VERSION % 1000 / 10);
}

// "sm_90" style name of a device.
inline std::string gpu_arch_name(const gpuDeviceProp_t& p) {
  return "sm_" + std::to_string(p.major) + std::to_string(p.minor);
}

// ---- 16-bit float storage types and their conversions (round to nearest even) ---------------
using gpu_f16 = __half;
using gpu_bf16 = __nv_bfloat16;

__device__ __forceinline__ float gpu_to_float(gpu_f16 v) { return __half2float(v); }
__device__ __forceinline__ float gpu_to_float(gpu_bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void gpu_from_float(float v, gpu_f16& out) { out = __float2half_rn(v); }
__device__ __forceinline__ void gpu_from_float(float v, gpu_bf16& out) { out = __float2bfloat16_rn(v); }

// ---- warp primitives ---------------------------------------------------------------------------
// Every lane of the warp takes part (the reductions in compat.cuh are called warp-uniformly).
__device__ __forceinline__ float gpu_shfl_xor(float v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
__device__ __forceinline__ int gpu_shfl_xor(int v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
// ---- asynchronous global -> shared copies (sm_80+: cp.async, SASS LDGSTS) ---------------------
// The copy runs while the thread goes on; copies committed together form a group; wait<N>
// returns once at most N of this thread's groups are still in flight. dst, src: 16-byte aligned.
__device__ __forceinline__ void gpu_copy16_async(void* dst_shared, const void* src_global) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src_global) : "memory");
}
__device__ __forceinline__ void gpu_copy16_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void gpu_copy16_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Lane l gets lane l - delta's value (its own below delta).
__device__ __forceinline__ float gpu_shfl_up(float v, int delta) { return __shfl_up_sync(0xffffffffu, v, delta); }
__device__ __forceinline__ int gpu_shfl_up(int v, int delta) { return __shfl_up_sync(0xffffffffu, v, delta); }

// ---- values every lane holds the same (gpu/decode/moe_items.cuh) ------------------------------------
// Equal in every lane: NVIDIA has no scalar registers to move it into (hip.h: readfirstlane).
__device__ __forceinline__ int32_t gpu_uniform(int32_t v) { return v; }

// ---- 4-bit weights (gpu/decode/int4.cuh) ------------------------------------------------------------
// Byte i (0..3, a compile-time constant after unrolling) of `word` as an exact f32 0..255: one byte
// permute into the mantissa of 2^23 (PRMT) and one subtraction, no integer-to-float conversion
// (I2F runs at a quarter of the FP32 rate).
__device__ __forceinline__ float gpu_byte_to_float(uint32_t word, int i) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7650u | unsigned(i))) - 8388608.f;
}

// ---- FP8 e4m3 weights (schedule::kWeightFp8) -----------------------------------------------------
// The encoding of the FP8 weights this vendor's decode kernel reads: OCP e4m3fn (exponent bias
// 7, max 448; Hopper's tensor-core format). The decode itself is shared (gpu/decode/fp8.cuh).
constexpr int kGpuFp8ExponentBias = 7;
