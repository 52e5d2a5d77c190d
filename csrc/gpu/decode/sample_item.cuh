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
#include "ops/sample_chunks.h"

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
  for (int it = 0; it < kSampleMaxHalvings && hi > lo; ++it) {
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

// ---- the chunked sampler (ops/sample_chunks.h) ---------------------------------------------
// SAMPLE is two phases in the decode kernel: the tail of the LM head's last item per chunk of
// kSampleChunk logits (kOpLinearSamplePartial) converts the chunk to the f32 logits output and
// summarizes it, for each row; SAMPLE, one item per row, draws from the summaries
// (sample_from_chunks), or, where they do not decide, runs sample_row over the f32 row.

constexpr int kSampleRadixBins = 256;  // 8-bit digits of the radix select, one bin per thread
static_assert(kThreads == kSampleRadixBins && kSampleChunk % kThreads == 0, "sample_chunk_item's thread layout");
// Shared floats of sample_chunk_item: the chunk (f32), the histogram, two reduction scratches,
// the selected digit and rank.
constexpr int kSampleChunkSmemFloats = kSampleChunk + kSampleRadixBins + 2 * (kWarps + 1) + 2;

// Order-preserving map of a float onto uint32 (x < y <=> key(x) < key(y) for non-NaN x, y).
__device__ __forceinline__ unsigned order_key(float x) {
  const unsigned u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The key of the rank-th largest (1-based, rank <= n) of the chunk's values, x[i] being value
// threadIdx.x + i * kThreads when that is < n: a radix select, 8 bits per pass from the top.
template <int kPer>
__device__ inline unsigned select_key(const float (&x)[kPer], int n, int rank, unsigned* hist, int* iscratch,
                                      int* sel) {
  unsigned prefix = 0, mask = 0;
  int remaining = rank;  // rank among the values matching prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    hist[threadIdx.x] = 0;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int v = int(threadIdx.x) + i * kThreads;
      const unsigned k = order_key(x[i]);
      if (v < n && (k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 0xFFu], 1u);
    }
    __syncthreads();
    const int digit = kSampleRadixBins - 1 - int(threadIdx.x);  // digits from high to low
    const int c = int(hist[digit]);
    int before = 0, total = 0;
    const int upto = block_scan(c, iscratch, &before, &total);  // values with a higher digit, then these
    if (before < remaining && upto >= remaining) sel[0] = digit, sel[1] = remaining - before;
    __syncthreads();
    prefix |= unsigned(sel[0]) << shift;
    mask |= 0xFFu << shift;
    remaining = sel[1];
  }
  return prefix;
}

// One (row, chunk) of the LM head's sample tail: logits_out[v] = row[v] as f32 for the chunk's v,
// *summary and the chunk's candidate slots values / indices [kSampleCandidateSlots] as
// summarize_chunk (ops/sample_chunks.h) computes them. smem: kSampleChunkSmemFloats floats.
template <typename T>
__device__ inline void sample_chunk_item(const T* __restrict__ row, float* __restrict__ logits_out, int64_t vocab,
                                         int64_t chunk, float temperature, SampleChunk* summary, float* values,
                                         int32_t* indices, float* smem) {
  constexpr int kPer = kSampleChunk / kThreads;
  float* stage = smem;  // [kSampleChunk] the chunk, f32
  unsigned* hist = reinterpret_cast<unsigned*>(smem + kSampleChunk);
  float* scratch = smem + kSampleChunk + kSampleRadixBins;
  int* iscratch = reinterpret_cast<int*>(scratch + kWarps + 1);
  int* sel = iscratch + kWarps + 1;
  const int64_t begin = chunk * kSampleChunk;
  const int n = int(vocab - begin < kSampleChunk ? vocab - begin : kSampleChunk);

  float x[kPer];  // value threadIdx.x + i * kThreads: coalesced loads and stores
  float best = -FLT_MAX, lowest = FLT_MAX;
  int arg = int(begin);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int v = int(threadIdx.x) + i * kThreads;
    x[i] = -FLT_MAX;
    if (v < n) {
      x[i] = gpu_to_float(row[begin + v]);
      logits_out[begin + v] = x[i];
      stage[v] = x[i];
      if (x[i] > best) best = x[i], arg = int(begin + v);
      lowest = fminf(lowest, x[i]);
    }
  }
  block_argmax(best, arg, scratch, iscratch);  // its syncs also publish stage
  lowest = -block_max(-lowest, scratch);
  SampleChunk s{best, int32_t(arg), lowest, 0.f, best, 0};
  if (temperature > 0.f) {
    const float inv_temp = 1.f / temperature;
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (int(threadIdx.x) + i * kThreads < n) m += expf((x[i] - best) * inv_temp);
    s.mass = block_sum(m, scratch);
    s.cutoff = n <= kSampleCandidates ? lowest : key_value(select_key(x, n, kSampleCandidates, hist, iscratch, sel));
    // The candidates in row order: each thread takes kPer consecutive values of the chunk.
    const int r0 = int(threadIdx.x) * kPer, r1 = r0 + kPer < n ? r0 + kPer : n;
    int mine = 0, at = 0, total = 0;
    for (int v = r0; v < r1; ++v) mine += stage[v] >= s.cutoff;
    block_scan(mine, iscratch, &at, &total);
    if (total > kSampleCandidateSlots) {
      s.n_cand = -1;  // ties at the cutoff: the draw falls back to the full row
    } else {
      s.n_cand = total;
      for (int v = r0; v < r1; ++v)
        if (stage[v] >= s.cutoff) values[at] = stage[v], indices[at] = int32_t(begin + v), ++at;
    }
  }
  if (threadIdx.x == 0) *summary = s;
}

// A workgroup as the team of sample_from_chunks.
struct WorkgroupTeam {
  using Acc = float;
  float* scratch;  // kWarps + 1 floats of shared memory
  int* iscratch;   // as many ints
  __device__ int rank() const { return int(threadIdx.x); }
  __device__ int size() const { return int(blockDim.x); }
  __device__ float sum(float v) const { return block_sum(v, scratch); }
  __device__ float exclusive_prefix(float mine, float& total) const {
    float before = 0.f;
    block_scan(mine, scratch, &before, &total);
    return before;
  }
  __device__ int32_t min(int32_t v) const { return block_min(v, iscratch); }
};

// One row of SAMPLE: the token from the row's chunk summaries, else sample_row over logits
// [vocab] f32. Every thread gets it. smem: kSampleSmemFloats floats.
__device__ inline int sample_from_summaries(const SampleChunk* chunks, int n_chunks, const float* values,
                                            const int32_t* indices, const float* logits, int vocab,
                                            const SamplingRow& sp, uint64_t counter, float* smem) {
  const WorkgroupTeam team{smem, reinterpret_cast<int*>(smem + kWarps + 1)};
  const int32_t token = sample_from_chunks(team, chunks, n_chunks, values, indices, logits, vocab, sp.temperature,
                                           sp.top_k, sp.top_p, sp.min_p, sp.seed, counter);
  if (token != kSampleFallback) return token;
  return sample_row(logits, vocab, sp, counter, smem);
}

}  // namespace kog::gpu::decode
