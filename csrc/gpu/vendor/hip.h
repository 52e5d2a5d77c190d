// AMD side of the vendor-neutral GPU API (the CUDA twin is cuda.h; only these two files and
// compat.cuh know which vendor is compiling). Maps the `gpu` names onto HIP.
#pragma once
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#include <hip/hip_version.h>
// ROCm >= 5.7 has CUDA-like __hip_bfloat16; older ROCm (Debian's 5.2) only hip_bfloat16.
#if __has_include(<hip/hip_bf16.h>)
#include <hip/hip_bf16.h>
#define KOG_HIP_HAS_BF16_H 1
#else
#include <hip/hip_bfloat16.h>
#endif

#include <string>

#define KOG_GPU_VENDOR "HIP"

using gpuError_t = hipError_t;
using gpuStream_t = hipStream_t;
using gpuDeviceProp_t = hipDeviceProp_t;

constexpr gpuError_t gpuSuccess = hipSuccess;

#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuGetDeviceProperties hipGetDeviceProperties
#define gpuGetDevice hipGetDevice
#define gpuSetDevice hipSetDevice
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuHostGetDevicePointer hipHostGetDevicePointer
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuFuncGetAttributes hipFuncGetAttributes
#define gpuFuncAttributes hipFuncAttributes
#define gpuMalloc hipMalloc
#define gpuFree hipFree
#define gpuMemsetAsync hipMemsetAsync
#define gpuLaunchCooperativeKernel hipLaunchCooperativeKernel
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuFuncSetAttribute hipFuncSetAttribute
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define gpuHostAlloc hipHostMalloc
#define gpuHostAllocMapped hipHostMallocMapped
#define gpuFreeHost hipHostFree
using gpuIpcMemHandle_t = hipIpcMemHandle_t;
#define gpuIpcGetMemHandle hipIpcGetMemHandle
#define gpuIpcOpenMemHandle hipIpcOpenMemHandle
#define gpuIpcCloseMemHandle hipIpcCloseMemHandle
#define gpuIpcMemLazyEnablePeerAccess hipIpcMemLazyEnablePeerAccess

// Device memory another device's kernel stores into and this device's kernel polls at system
// scope (the tensor-parallel flags, gpu/decode/rank_items.cuh): fine-grained -- uncached where
// the runtime has it (ROCm >= 6) --, since coarse-grained memory gives no cross-device
// visibility before a kernel ends.
inline gpuError_t gpu_malloc_signals(void** p, size_t bytes) {
#if defined(hipDeviceMallocUncached)
  return hipExtMallocWithFlags(p, bytes, hipDeviceMallocUncached);
#else
  return hipExtMallocWithFlags(p, bytes, hipDeviceMallocFinegrained);
#endif
}

// Ticks of gpu_wall_ticks per millisecond on `device`: s_memrealtime runs at the device's
// constant wall-clock rate (100 MHz on CDNA2/3), reported in kHz.
inline int64_t gpu_wall_ticks_per_ms(int device) {
  int khz = 0;
#if HIP_VERSION >= 50300000  // the attribute is newer than ROCm 5.2 (the CI's compile check)
  if (hipDeviceGetAttribute(&khz, hipDeviceAttributeWallClockRate, device) != hipSuccess) khz = 0;
#else
  (void)device;
#endif
  return khz > 0 ? khz : 100000;
}

// The device's wall clock (for bounded spin waits), and a trap that kills the launch.
__device__ __forceinline__ uint64_t gpu_wall_ticks() { return __builtin_amdgcn_s_memrealtime(); }
__device__ __forceinline__ void gpu_trap() { __builtin_trap(); }

// Runtime the module was compiled against, e.g. "HIP 6.2".
inline std::string gpu_runtime_version() {
  return "HIP " + std::to_string(HIP_VERSION_MAJOR) + "." + std::to_string(HIP_VERSION_MINOR);
}

// "gfx942" style name of a device (gcnArchName also carries feature flags: "gfx942:sramecc+:xnack-").
inline std::string gpu_arch_name(const gpuDeviceProp_t& p) {
  const std::string full = p.gcnArchName;
  return full.substr(0, full.find(':'));
}

// ---- 16-bit float storage types and their conversions (round to nearest even) ---------------
using gpu_f16 = __half;
__device__ __forceinline__ float gpu_to_float(gpu_f16 v) { return __half2float(v); }
__device__ __forceinline__ void gpu_from_float(float v, gpu_f16& out) { out = __float2half_rn(v); }

#ifdef KOG_HIP_HAS_BF16_H
using gpu_bf16 = __hip_bfloat16;
__device__ __forceinline__ float gpu_to_float(gpu_bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void gpu_from_float(float v, gpu_bf16& out) { out = __float2bfloat16(v); }
#else
using gpu_bf16 = hip_bfloat16;
__device__ __forceinline__ float gpu_to_float(gpu_bf16 v) { return float(v); }
// The float constructor rounds to nearest even (hip_bfloat16::float_to_bfloat16).
__device__ __forceinline__ void gpu_from_float(float v, gpu_bf16& out) { out = gpu_bf16(v); }
#endif

// ---- warp primitives ---------------------------------------------------------------------------
// HIP's __shfl_xor covers the whole wavefront (32 or 64 lanes) without a mask.
__device__ __forceinline__ float gpu_shfl_xor(float v, int lane_mask) {
  return __shfl_xor(v, lane_mask);
}
__device__ __forceinline__ int gpu_shfl_xor(int v, int lane_mask) { return __shfl_xor(v, lane_mask); }
// Lane l gets lane l - delta's value (its own below delta).
__device__ __forceinline__ float gpu_shfl_up(float v, int delta) { return __shfl_up(v, unsigned(delta)); }
__device__ __forceinline__ int gpu_shfl_up(int v, int delta) { return __shfl_up(v, unsigned(delta)); }

// ---- values every lane holds the same (gpu/decode/moe_items.cuh) ------------------------------------
// v, which the caller knows is equal in every lane, as a scalar register: values the kernel loads
// from memory it wrote itself (vector loads) would otherwise keep loop bounds and addresses in
// VGPRs (v_readfirstlane_b32).
__device__ __forceinline__ int32_t gpu_uniform(int32_t v) { return __builtin_amdgcn_readfirstlane(v); }

// ---- 4-bit weights (gpu/decode/int4.cuh) ------------------------------------------------------------
// Byte i (0..3, a compile-time constant after unrolling) of `word` as an exact f32 0..255: CDNA
// converts a register's byte directly (v_cvt_f32_ubyte0..3), which this shift-and-mask compiles to.
__device__ __forceinline__ float gpu_byte_to_float(uint32_t word, int i) {
  return float((word >> (8 * i)) & 0xFFu);
}

// ---- FP8 e4m3 weights (schedule::kWeightFp8) -----------------------------------------------------
// The encoding of the FP8 weights this vendor's decode kernel reads: e4m3fnuz (exponent bias 8,
// max 240, no negative zero or infinity; MI300X's hardware format, so one weight file serves a
// later hardware decode too). The decode itself is shared (gpu/decode/fp8.cuh).
constexpr int kGpuFp8ExponentBias = 8;
