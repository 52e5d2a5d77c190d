// Sampling of f32 logits rows on the CPU with the semantics of the GPU decode kernel's
// sample_row (csrc/gpu/decode/sample_item.cuh), preceded by the host-side adjustments the GPU
// kernel leaves out (banned ids, repetition / presence / frequency penalties).
//
// Per row, in order:
//   1. banned ids -> -inf (EOS and stop ids while fewer than min_tokens tokens are out);
//   2. repetition penalty on seen ids: x > 0 ? x / r : x * r; then x = x - f * count - p on
//      output ids (f: frequency, p: presence, count >= 1);
//   3. temperature <= 0 (or NaN): argmax, ties to the lowest index;
//   4. else thresholds on the logit, each found by the GPU's float bisection (at most 40
//      halvings of [lo, hi], stopping when the midpoint is no longer strictly inside):
//      top-k: largest t with count(x >= t) >= k; min-p: t >= best + log(min_p) * temperature;
//      top-p: largest t >= the previous with mass(x >= t) >= top_p * mass(x >= previous t),
//      mass = sum exp((x - best) / temperature); ties at a threshold are all kept; the argmax
//      always is;
//   5. u = uniform01(seed, counter) * kept mass; the token is the first index (in vocabulary
//      order) whose running kept mass exceeds u (the argmax if rounding leaves u past the end).
// Masses are summed in double here (float on the GPU), so the two agree except where a draw or
// a top-p cut falls within rounding of a boundary. -inf logits are never kept and do not count
// as the lowest logit (the GPU never sees -inf: it bans nothing).
#pragma once
#include <cstdint>

#include "common/host_device.h"

namespace kog {

// Most halvings of a threshold bisection (step 4), on every path that bisects.
constexpr int kSampleMaxHalvings = 40;

// Uniform [0, 1) from (seed, counter): splitmix64 finalizer over both, top 24 bits. The one
// definition of the draw: the CPU sampler and the GPU kernel (gpu/decode/sample_item.cuh) call it.
// static: every translation unit (each CPU ISA build included) keeps its own copy.
static KOG_HOST_DEVICE inline float uniform01(uint64_t seed, uint64_t counter) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + counter + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(z >> 40) * (1.f / 16777216.f);
}

// One row's sampling: the GPU SamplingRow's fields, the draw counter and the host adjustments.
struct SampleRowParams {
  float temperature;             // <= 0: greedy
  int32_t top_k;                 // <= 0 or >= vocab: off
  float top_p;                   // >= 1: off
  float min_p;                   // <= 0: off
  uint64_t seed;
  uint64_t counter;              // the draw's index (the output index of the token sampled)
  float repetition_penalty;      // 1: off
  float presence_penalty;        // 0: off
  float frequency_penalty;       // 0: off
  const int32_t* seen_ids;       // [n_seen] distinct ids of prompt + output (repetition)
  int64_t n_seen;
  const int32_t* output_ids;     // [n_output_ids] distinct output ids
  const int32_t* output_counts;  // [n_output_ids] occurrences of each in the output, >= 1
  int64_t n_output_ids;
  const int32_t* banned_ids;     // [n_banned] set to -inf before anything else
  int64_t n_banned;
};

struct SampleParams {
  float* logits;                 // [n_rows, vocab] f32, contiguous; steps 1-2 write into it
  int64_t n_rows;
  int64_t vocab;
  const SampleRowParams* rows;   // [n_rows]
  int32_t* tokens;               // [n_rows] out
  float* scratch;                // [vocab] f32 workspace
};

}  // namespace kog
