// Cross-workgroup dependencies of the persistent decode kernel, and block reductions that may
// run any number of times per kernel.
//
// Every wait of the persistent kernel is bounded (spin_until): one that outlives its timeout
// records the op, counter and target and traps (persistent_kernel.cuh, wait_for_ops).
//
// Protocol: a workgroup finishing a work item of op g does  __syncthreads; thread 0: release
// fence + atomicAdd(counters[g], 1).  A workgroup starting op g + 1 has thread 0 spin until
// counters[g] reaches op g's item count with acquire loads, then __syncthreads and an acquire
// fence in every thread, so its later loads see every item's stores (L1 is not coherent across
// multiprocessors on either vendor; the acquire side discards stale lines).
#pragma once
#include "gpu/compat.cuh"
#include "gpu/decode/params.h"

namespace kog::gpu::decode {

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
#if defined(KOG_GPU_HIP)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
#else
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

__device__ __forceinline__ void fence_acquire() {
#if defined(KOG_GPU_HIP)
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "agent");
#else
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
#endif
}

// System scope (another GPU's stores into this GPU's memory, or ours into its): the cross-rank
// flags (rank_items.cuh).
__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
#if defined(KOG_GPU_HIP)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#endif
}

// A strong store at system scope without a fence of its own: after a __threadfence_system(), the
// fence and the store are the release (one fence for the stores to every rank, where a release
// store would put a system fence before each).
__device__ __forceinline__ void store_relaxed_sys(uint64_t* p, uint64_t v) {
#if defined(KOG_GPU_HIP)
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

__device__ __forceinline__ void fence_acquire_sys() {
#if defined(KOG_GPU_HIP)
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "");
#else
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}

__device__ __forceinline__ void backoff() {
#if defined(KOG_GPU_HIP)
  __builtin_amdgcn_s_sleep(1);
#else
  __nanosleep(64);
#endif
}

// Spins (one thread) until load() >= target; false if timeout_ticks (gpu_wall_ticks; 0: no
// limit) passed first.
template <typename V, typename Load>
__device__ __forceinline__ bool spin_until_loaded(Load load, V target, uint64_t timeout_ticks) {
  if (load() >= target) return true;
  const uint64_t t0 = gpu_wall_ticks();
  while (load() < target) {
    backoff();
    if (timeout_ticks != 0 && gpu_wall_ticks() - t0 > timeout_ticks) return false;
  }
  return true;
}

// ... a counter of this GPU (agent scope: the workgroups' item counts).
__device__ __forceinline__ bool spin_until(const unsigned* counter, unsigned target, uint64_t timeout_ticks) {
  return spin_until_loaded([counter] { return load_acquire(counter); }, target, timeout_ticks);
}

// ... a flag other GPUs store into (system scope: the cross-rank flags).
__device__ __forceinline__ bool spin_until_sys(const uint64_t* flag, uint64_t target, uint64_t timeout_ticks) {
  return spin_until_loaded([flag] { return load_acquire_sys(flag); }, target, timeout_ticks);
}

// A bounded wait gave up (one thread): the first to time out records where in *t (host-mapped:
// readable after the trap kills the launch), then every one traps.
__device__ __forceinline__ void trap_timed_out(WaitTimeout* t, int32_t step, int32_t op, unsigned count,
                                               unsigned target) {
  if (atomicCAS(&t->fired, 0, 1) == 0) {
    t->block = int32_t(blockIdx.x), t->step = step, t->op = op, t->count = count, t->target = target;
    __threadfence_system();
  }
  gpu_trap();
}

// Every thread calls it after its stores of one work item of a group of n items (an op's tail
// runs on the group's last item to finish: the attention merge, the LM head's sample partial).
// Counts the item on *count with release; true on every thread of the last item, which then has
// acquired the group's stores and has reset *count to 0 for the group's next op (that op starts
// after this one's signals, which publish the reset). flag: one shared float, free on return.
__device__ __forceinline__ bool last_of_group(unsigned* count, unsigned n, float* flag) {
  __syncthreads();  // every warp's stores of the item
  if (threadIdx.x == 0) {
    __threadfence();  // release: the item's stores before the count
    const bool last = atomicAdd(count, 1u) == n - 1;
    if (last) *count = 0;
    *flag = last ? 1.f : 0.f;
  }
  __syncthreads();
  const bool last = *flag != 0.f;
  __syncthreads();  // every thread read the flag: its shared float may be reused
  if (last) fence_acquire();
  return last;
}

// Every thread calls it after its stores of one work item.
__device__ __forceinline__ void signal_done(unsigned* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // release: the item's stores before the count
    atomicAdd(counter, 1u);
  }
}

// Sum over the workgroup; every thread gets it. scratch: kMaxBlockThreads / KOG_WARP_SIZE + 1
// floats of shared memory, reusable right after the call returns.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int n_warps = blockDim.x / KOG_WARP_SIZE;
  v = warp_reduce_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < n_warps; ++w) total += scratch[w];
  return total;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int n_warps = blockDim.x / KOG_WARP_SIZE;
  v = warp_reduce_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < n_warps; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// (value, index) argmax over the workgroup, ties to the lowest index; every thread gets it.
__device__ __forceinline__ void block_argmax(float& v, int& idx, float* fscratch, int* iscratch) {
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int n_warps = blockDim.x / KOG_WARP_SIZE;
#pragma unroll
  for (int m = KOG_WARP_SIZE / 2; m > 0; m >>= 1) {
    const float ov = gpu_shfl_xor(v, m);
    const int oi = gpu_shfl_xor(idx, m);
    if (ov > v || (ov == v && oi < idx)) v = ov, idx = oi;
  }
  __syncthreads();
  if (lane == 0) fscratch[warp] = v, iscratch[warp] = idx;
  __syncthreads();
  v = fscratch[0], idx = iscratch[0];
  for (int w = 1; w < n_warps; ++w)
    if (fscratch[w] > v || (fscratch[w] == v && iscratch[w] < idx)) v = fscratch[w], idx = iscratch[w];
}

// Prefix sums over the workgroup in thread order: returns the inclusive sum; *exclusive gets
// the previous thread's inclusive sum exactly (0 for thread 0), so [exclusive, inclusive) ranges
// tile without gaps; *total the sum of all (every thread). scratch: kMaxBlockThreads /
// KOG_WARP_SIZE values of shared memory.
template <typename V>
__device__ __forceinline__ V block_scan(V v, V* scratch, V* exclusive, V* total) {
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int n_warps = blockDim.x / KOG_WARP_SIZE;
#pragma unroll
  for (int d = 1; d < KOG_WARP_SIZE; d <<= 1) {
    const V o = gpu_shfl_up(v, d);
    if (lane >= d) v += o;
  }
  const V prev = gpu_shfl_up(v, 1);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == KOG_WARP_SIZE - 1) scratch[warp] = v;
  __syncthreads();
  V before = V(0), all = V(0);
  for (int w = 0; w < n_warps; ++w) {
    if (w < warp) before += scratch[w];
    all += scratch[w];
  }
  *exclusive = lane == 0 ? before : prev + before;
  *total = all;
  return v + before;
}

__device__ __forceinline__ int block_min(int v, int* scratch) {
  const int lane = threadIdx.x % KOG_WARP_SIZE, warp = threadIdx.x / KOG_WARP_SIZE;
  const int n_warps = blockDim.x / KOG_WARP_SIZE;
#pragma unroll
  for (int m = KOG_WARP_SIZE / 2; m > 0; m >>= 1) v = min(v, gpu_shfl_xor(v, m));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int r = scratch[0];
  for (int w = 1; w < n_warps; ++w) r = min(r, scratch[w]);
  return r;
}

}  // namespace kog::gpu::decode
