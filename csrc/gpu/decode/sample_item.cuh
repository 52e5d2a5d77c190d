// On-device sampling of one row of f32 logits: argmax (temperature <= 0), or a seeded draw from
// softmax(logits / temperature) restricted by top-k, min-p and top-p. One workgroup per row.
//
// Filters are thresholds on the logit, found by bisection with workgroup-wide counts/sums, so
// no sort is needed: top-k keeps logits >= the largest t with count(x >= t) >= k (ties at the
// boundary are all kept); min-p keeps p >= min_p * p_max; top-p keeps the smallest high-logit
// set whose mass reaches top_p (again with boundary ties). The draw u ~ U[0, kept mass) is a
// hash of (seed, counter), and the token is found by a prefix sum over contiguous index
// ranges per thread, so results depend only on (logits, params, seed, counter).
#pragma once
#include <cfloat>

#include "gpu/decode/params.h"
#include "gpu/decode/sync.cuh"
#include "gpu/decode/tuning.cuh"
#include "ops/sample.h"  // uniform01: the draw, shared with the CPU sampler

namespace kog::gpu::decode {

// Shared scratch of sample_row, in floats.
constexpr int kSampleSmemFloats = 2 * kThreads + 2;

// Count (or exp-mass with mass=true) of logits >= t.
__device__ __forceinline__ float mass_above(const float* x, int vocab, float t, float x_max, float inv_temp,
                                            bool mass, float* scratch) {
  float s = 0.f;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x)
    if (x[v] >= t) s += mass ? expf((x[v] - x_max) * inv_temp) : 1.f;
  return block_sum(s, scratch);
}

// Largest threshold in [lo, hi] with mass_above(t) >= target (bisection on the logit).
__device__ inline float bisect_threshold(const float* x, int vocab, float lo, float hi, float target, float x_max,
                                  float inv_temp, bool mass, float* scratch) {
  for (int it = 0; it < 40 && hi > lo; ++it) {
    const float mid = 0.5f * (lo + hi);
    if (mid <= lo || mid >= hi) break;
    if (mass_above(x, vocab, mid, x_max, inv_temp, mass, scratch) >= target) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Returns the sampled token (every thread gets it). smem: kSampleSmemFloats floats.
__device__ inline int sample_row(const float* x, int vocab, const SamplingRow& sp, uint64_t counter, float* smem) {
  int* iscratch = reinterpret_cast<int*>(smem + kThreads);
  float best = -FLT_MAX, lowest = FLT_MAX;
  int arg = 0;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    if (x[v] > best) best = x[v], arg = v;
    lowest = fminf(lowest, x[v]);
  }
  lowest = -block_max(-lowest, smem);
  block_argmax(best, arg, smem, iscratch);
  if (!(sp.temperature > 0.f)) return arg;

  const float inv_temp = 1.f / sp.temperature;
  float lo = lowest;
  if (sp.top_k > 0 && sp.top_k < vocab)
    lo = bisect_threshold(x, vocab, lowest, best, float(sp.top_k), best, inv_temp, false, smem);
  if (sp.min_p > 0.f) lo = fmaxf(lo, best + logf(sp.min_p) * sp.temperature);
  if (sp.top_p < 1.f) {
    const float total = mass_above(x, vocab, lo, best, inv_temp, true, smem);
    lo = bisect_threshold(x, vocab, lo, best, sp.top_p * total, best, inv_temp, true, smem);
  }
  lo = fminf(lo, best);  // the argmax is always kept

  // Prefix sum over per-thread contiguous ranges [r0, r1).
  const int per = (vocab + blockDim.x - 1) / blockDim.x;
  const int r0 = min(vocab, int(threadIdx.x) * per), r1 = min(vocab, r0 + per);
  float mine = 0.f;
  for (int v = r0; v < r1; ++v)
    if (x[v] >= lo) mine += expf((x[v] - best) * inv_temp);
  __syncthreads();
  smem[threadIdx.x] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    float run = 0.f;
    for (int t = 0; t < int(blockDim.x); ++t) {
      const float s = smem[t];
      smem[t] = run;  // exclusive prefix
      run += s;
    }
    smem[kThreads] = run;
    iscratch[kThreads] = arg;  // fallback when rounding puts u past the last kept token
  }
  __syncthreads();
  const float u = uniform01(sp.seed, counter) * smem[kThreads];
  float run = smem[threadIdx.x];
  if (mine > 0.f && u >= run && u < run + mine) {
    for (int v = r0; v < r1; ++v) {
      if (x[v] < lo) continue;
      run += expf((x[v] - best) * inv_temp);
      if (u < run) {
        iscratch[kThreads] = v;
        break;
      }
    }
  }
  __syncthreads();
  const int token = iscratch[kThreads];
  __syncthreads();
  return token;
}

}  // namespace kog::gpu::decode
