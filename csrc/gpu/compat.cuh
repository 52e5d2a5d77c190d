// What every GPU source includes: the vendor API (vendor/cuda.h or vendor/hip.h, picked by the
// KOG_GPU_CUDA / KOG_GPU_HIP definitions CMake sets), the warp size of the target being compiled,
// warp and block reductions, typed loads/stores and KOG_GPU_CHECK.
#pragma once
#include <cstdint>

#include "common/dtype.h"
#include "common/errors.h"

#if defined(KOG_GPU_HIP)
#include "gpu/vendor/hip.h"
#elif defined(KOG_GPU_CUDA)
#include "gpu/vendor/cuda.h"
#else
#error "compile GPU sources with KOG_GPU_CUDA or KOG_GPU_HIP defined (see CMakeLists.txt)"
#endif

// ---- warp size: a property of the compile target, never a literal in kernel code ---------------
// NOTE: each device pass sees its own value (64 on gfx9 = GCN/CDNA incl. MI300X, 32 on NVIDIA
// and by default on RDNA). The host pass of a HIP build also defines a value, but host code must
// not size launches by it: one binary serves targets of both widths, so block sizes are
// multiples of kMaxWarpSize instead.
#if defined(__HIP_DEVICE_COMPILE__)
#if defined(__GFX9__)
#define KOG_WARP_SIZE 64
#elif defined(__AMDGCN_WAVEFRONT_SIZE)
#define KOG_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define KOG_WARP_SIZE 32
#endif
#elif defined(KOG_GPU_HIP)
#define KOG_WARP_SIZE 64  // host pass: parses kernel bodies, generates no device code
#else
#define KOG_WARP_SIZE 32  // nvcc, device and host passes
#endif

// ---- errors ------------------------------------------------------------------------------------
#define KOG_GPU_CHECK(expr)                                                                   \
  do {                                                                                        \
    const gpuError_t kog_gpu_err_ = (expr);                                                   \
    if (kog_gpu_err_ != gpuSuccess)                                                           \
      ::kog::throw_error(::kog::ErrorKind::kBackend, KOG_GPU_VENDOR " error at " __FILE__ ":", \
                         __LINE__, " (" #expr "): ", gpuGetErrorString(kog_gpu_err_));        \
  } while (0)

// After a <<<...>>> launch: reports a bad configuration or a missing kernel image at once
// (faults inside the kernel surface at the next synchronizing call).
#define KOG_GPU_CHECK_LAUNCH() KOG_GPU_CHECK(gpuGetLastError())

// fp32 twins of the vendor conversions, so kernels convert every storage type alike.
__device__ __forceinline__ float gpu_to_float(float v) { return v; }
__device__ __forceinline__ void gpu_from_float(float v, float& out) { out = v; }

namespace kog::gpu {

// Block sizes chosen on the host are multiples of this, so every warp of a block is full on
// every target (the shuffle reductions below rely on it).
constexpr int kMaxWarpSize = 64;
constexpr int kMaxBlockThreads = 1024;

// ---- fp32 <-> storage type (one rounding per stored value) -------------------------------
template <typename T>
__device__ __forceinline__ float load_f32(const T* p) { return gpu_to_float(*p); }
template <typename T>
__device__ __forceinline__ void store_f32(T* p, float v) {
  T t;
  gpu_from_float(v, t);
  *p = t;
}
// v rounded to T, back in f32: what a store_f32 and a load_f32 of v give.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  T t;
  store_f32(&t, v);
  return load_f32(&t);
}

// N elements moved as one 16-byte (or smaller) access; pointers must be aligned to sizeof(Vec).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements per 16-byte access of T.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

// One 16-byte load of a Vec as a single 128-bit instruction (LDG.E.128 / global_load_dwordx4).
// A plain copy of Vec<bf16 or half, 8> is element-wise on NVIDIA (their copy constructors):
// eight 2-byte loads. p: 16-byte aligned.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load16(const Vec<T, N>* p) {
  static_assert(sizeof(Vec<T, N>) == 16, "load16 moves exactly 16 bytes");
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  Vec<T, N> out;
  __builtin_memcpy(&out, &raw, 16);
  return out;
}

inline bool aligned_to(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// ---- reductions --------------------------------------------------------------------------------
// Called by every lane of a warp (full warps only, see kMaxWarpSize); every lane gets the result.
__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int m = KOG_WARP_SIZE / 2; m > 0; m >>= 1) v += gpu_shfl_xor(v, m);
  return v;
}

__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
  for (int m = KOG_WARP_SIZE / 2; m > 0; m >>= 1) v = fmaxf(v, gpu_shfl_xor(v, m));
  return v;
}

// Sum over the block; every thread gets the result. Called by all threads of a block whose size
// is a multiple of the warp size and at most kMaxBlockThreads; at most once per kernel (its
// shared scratch is not reset between calls).
__device__ __forceinline__ float block_reduce_sum(float v) {
  __shared__ float warp_sums[kMaxBlockThreads / KOG_WARP_SIZE];
  __shared__ float total;
  const int lane = threadIdx.x % KOG_WARP_SIZE;
  const int warp = threadIdx.x / KOG_WARP_SIZE;
  const int n_warps = blockDim.x / KOG_WARP_SIZE;
  v = warp_reduce_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = warp_reduce_sum(lane < n_warps ? warp_sums[lane] : 0.f);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// ---- host helpers ------------------------------------------------------------------------
// Calls f(T{}) with T the storage type of a float DType.
template <typename F>
void dispatch_float(DType t, F&& f) {
  switch (t) {
    case DType::kF32: return f(float{});
    case DType::kF16: return f(gpu_f16{});
    case DType::kBF16: return f(gpu_bf16{});
    default:
      throw_error(ErrorKind::kInvalidArgument, "GPU kernels take float32/float16/bfloat16, not ",
                  dtype_name(t));
  }
}

inline gpuStream_t as_stream(void* stream) { return static_cast<gpuStream_t>(stream); }

// Smallest multiple of kMaxWarpSize >= n, clamped to [kMaxWarpSize, max_threads].
inline int block_threads_for(int64_t n, int max_threads) {
  const int64_t r = (n + kMaxWarpSize - 1) / kMaxWarpSize * kMaxWarpSize;
  return static_cast<int>(r < kMaxWarpSize ? kMaxWarpSize : (r > max_threads ? max_threads : r));
}

}  // namespace kog::gpu
