// CPU sampling kernel. Contract: csrc/ops/sample.h.
//
// The bisections run the GPU's exact sequence of midpoints, but each probe costs less: the
// values still inside [lo, hi) are kept compacted in scratch and the count / mass of those
// >= hi carried along, so a probe scans only what is left of the interval (a full pass
// first, then a shrinking set) instead of the whole vocabulary.
#include <math.h>

#include "cpu/vec.h"
#include "ops/sample.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

constexpr float kNegInf = -__builtin_inff();

void adjust(float* x, int64_t vocab, const SampleRowParams& r) {
  for (int64_t i = 0; i < r.n_banned; ++i) {
    const int32_t t = r.banned_ids[i];
    if (t >= 0 && t < vocab) x[t] = kNegInf;
  }
  if (r.repetition_penalty != 1.f) {
    for (int64_t i = 0; i < r.n_seen; ++i) {
      const int32_t t = r.seen_ids[i];
      if (t < 0 || t >= vocab) continue;
      x[t] = x[t] > 0.f ? x[t] / r.repetition_penalty : x[t] * r.repetition_penalty;
    }
  }
  if (r.presence_penalty != 0.f || r.frequency_penalty != 0.f) {
    for (int64_t i = 0; i < r.n_output_ids; ++i) {
      const int32_t t = r.output_ids[i];
      if (t < 0 || t >= vocab) continue;
      x[t] = (x[t] - r.frequency_penalty * float(r.output_counts[i])) - r.presence_penalty;
    }
  }
}

// The weight of a kept logit: exp((x - best) / temperature), as the GPU computes it.
inline double weight(float x, float best, float inv_temp) { return double(expf((x - best) * inv_temp)); }

// The measure bisected: count (mass = false) or exp-mass of a value.
inline double measure(float x, bool mass, float best, float inv_temp) {
  return mass ? weight(x, best, inv_temp) : 1.0;
}

// Largest float bisection point t in [lo, hi] with measure(x >= t) >= target (GPU order of
// midpoints). cand: scratch of vocab floats.
float bisect_threshold(const float* x, int64_t vocab, float lo, float hi, double target, bool mass, float best,
                       float inv_temp, float* cand) {
  int64_t n = 0;
  double above = 0.0;  // measure of values >= hi
  for (int64_t v = 0; v < vocab; ++v) {
    if (x[v] >= hi) above += measure(x[v], mass, best, inv_temp);
    else if (x[v] >= lo) cand[n++] = x[v];
  }
  for (int it = 0; it < kSampleMaxHalvings && hi > lo; ++it) {
    const float mid = 0.5f * (lo + hi);
    if (mid <= lo || mid >= hi) break;
    double m = above;
    for (int64_t i = 0; i < n; ++i)
      if (cand[i] >= mid) m += measure(cand[i], mass, best, inv_temp);
    int64_t kept = 0;
    if (m >= target) {  // lo = mid: [mid, hi) stays
      lo = mid;
      for (int64_t i = 0; i < n; ++i)
        if (cand[i] >= mid) cand[kept++] = cand[i];
    } else {            // hi = mid: what was >= mid is now above
      hi = mid;
      above = m;
      for (int64_t i = 0; i < n; ++i)
        if (cand[i] < mid) cand[kept++] = cand[i];
    }
    n = kept;
  }
  return lo;
}

int32_t sample_row(float* x, int64_t vocab, const SampleRowParams& r, float* scratch) {
  adjust(x, vocab, r);
  float best = kNegInf, lowest = __builtin_inff();
  int64_t arg = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    if (x[v] > best) best = x[v], arg = v;
    if (x[v] > kNegInf && x[v] < lowest) lowest = x[v];
  }
  if (!(r.temperature > 0.f) || !(lowest <= best)) return int32_t(arg);

  const float inv_temp = 1.f / r.temperature;
  float lo = lowest;
  if (r.top_k > 0 && r.top_k < vocab)
    lo = bisect_threshold(x, vocab, lowest, best, double(r.top_k), false, best, inv_temp, scratch);
  if (r.min_p > 0.f) lo = fmaxf(lo, best + logf(r.min_p) * r.temperature);
  if (r.top_p < 1.f) {
    double total = 0.0;
    for (int64_t v = 0; v < vocab; ++v)
      if (x[v] >= lo) total += weight(x[v], best, inv_temp);
    lo = bisect_threshold(x, vocab, lo, best, double(r.top_p) * total, true, best, inv_temp, scratch);
  }
  lo = fminf(lo, best);

  // The draw: the kept mass, then a second pass in vocabulary order up to u.
  double kept = 0.0;
  for (int64_t v = 0; v < vocab; ++v)
    if (x[v] >= lo) kept += weight(x[v], best, inv_temp);
  const double u = double(uniform01(r.seed, r.counter)) * kept;
  double run = 0.0;
  for (int64_t v = 0; v < vocab; ++v) {
    if (!(x[v] >= lo)) continue;
    run += weight(x[v], best, inv_temp);
    if (u < run) return int32_t(v);
  }
  return int32_t(arg);
}

}  // namespace

void sample(const SampleParams& p) {
  for (int64_t b = 0; b < p.n_rows; ++b)
    p.tokens[b] = sample_row(p.logits + b * p.vocab, p.vocab, p.rows[b], p.scratch);
}

}  // namespace kog::cpu::KOG_ISA_NS
