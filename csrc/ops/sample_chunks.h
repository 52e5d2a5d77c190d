// Sampling a row of logits from per-chunk summaries: the decode kernel's parallel sampler.
//
// The row is cut into chunks of kSampleChunk logits. Many workgroups summarize one chunk each
// (the GPU's sample_chunk_item; summarize_chunk below is its CPU reference): largest logit and
// its index, lowest logit, exp-mass at the row's temperature, and the chunk's candidates: every
// logit >= the chunk's cutoff (its kSampleCandidates-th largest value, or its lowest when it has
// fewer), in row order. One team per row (a workgroup; the host's one thread in tests) then
// draws from the summaries (sample_from_chunks) with the semantics of the full-row sampler
// (ops/sample.h): the same bisection midpoints, the same kept set, the same draw.
//
// Why that is exact: every logit of the row >= tau = the largest cutoff is a candidate (it is
// >= its own chunk's cutoff). A bisection probe at t >= tau is measured exactly on the
// candidates; a probe at t < tau measures at least M(tau), the candidates' measure >= tau, so
// its outcome (measure >= target) is known whenever M(tau) >= target. A threshold >= tau keeps
// candidates only; a threshold at the row's lowest logit keeps the whole row, whose mass is the
// sum of the chunks' masses and whose draw scans one chunk. Anything else (an undecidable
// probe, a threshold between the lowest and tau, candidates needed where ties at a cutoff
// overflowed a chunk's slots) returns kSampleFallback, and the caller runs the full-row
// sampler. For the sampling agents use (greedy; temperature with top-k <= kSampleCandidates,
// top-p over a peaked distribution, min-p, or no filter) the summaries decide.
//
// Sums are Team::Acc (float on the GPU, double on the host), so GPU and CPU agree except where
// a draw or a top-p cut falls within rounding of a boundary, as for the full-row sampler.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/host_device.h"
#include "ops/sample.h"

namespace kog {

constexpr int kSampleChunk = 4096;          // logits per chunk summary
constexpr int kSampleCandidates = 64;       // a chunk keeps its values >= its 64th largest
constexpr int kSampleCandidateSlots = 128;  // room per chunk for those and ties at the cutoff
constexpr int32_t kSampleFallback = -1;     // sample_from_chunks: run the full-row sampler

// One chunk [chunk * kSampleChunk, min(vocab, (chunk + 1) * kSampleChunk)) of a row.
struct SampleChunk {
  float max;       // largest logit
  int32_t arg;     // its index in the row (the lowest on ties)
  float lowest;    // smallest logit
  float mass;      // sum of exp((x - max) / temperature) over the chunk; 0 for a greedy row
  float cutoff;    // every logit of the chunk >= cutoff is a candidate (greedy rows: max)
  int32_t n_cand;  // candidates in the chunk's slots; -1 when ties overflowed the slots
};

KOG_HOST_DEVICE inline int64_t sample_chunks(int64_t vocab) { return (vocab + kSampleChunk - 1) / kSampleChunk; }

// CPU reference of the GPU chunk summary. x: the row's logits [vocab]; values / indices:
// [kSampleCandidateSlots] the chunk's candidate slots.
inline SampleChunk summarize_chunk(const float* x, int64_t vocab, int64_t chunk, float temperature, float* values,
                                   int32_t* indices) {
  const int64_t begin = chunk * kSampleChunk, n = std::min<int64_t>(kSampleChunk, vocab - begin);
  SampleChunk s{x[begin], int32_t(begin), x[begin], 0.f, 0.f, 0};
  for (int64_t v = begin; v < begin + n; ++v) {
    if (x[v] > s.max) s.max = x[v], s.arg = int32_t(v);
    s.lowest = std::min(s.lowest, x[v]);
  }
  s.cutoff = s.max;
  if (!(temperature > 0.f)) return s;
  const float inv_temp = 1.f / temperature;
  double mass = 0.0;
  for (int64_t v = begin; v < begin + n; ++v) mass += double(expf((x[v] - s.max) * inv_temp));
  s.mass = float(mass);
  if (n <= kSampleCandidates) {
    s.cutoff = s.lowest;
  } else {
    std::vector<float> sorted(x + begin, x + begin + n);
    std::nth_element(sorted.begin(), sorted.begin() + (kSampleCandidates - 1), sorted.end(), std::greater<float>());
    s.cutoff = sorted[kSampleCandidates - 1];
  }
  for (int64_t v = begin; v < begin + n; ++v) {
    if (!(x[v] >= s.cutoff)) continue;
    if (s.n_cand == kSampleCandidateSlots) return s.n_cand = -1, s;
    values[s.n_cand] = x[v], indices[s.n_cand] = int32_t(v), ++s.n_cand;
  }
  return s;
}

// The token of one row from its chunk summaries, or kSampleFallback (see the top of the file).
//   chunks: [n_chunks]; values / indices: [n_chunks, kSampleCandidateSlots] candidate slots;
//   logits: [vocab] the row (read only to draw inside one chunk when nothing is filtered).
// Team: the members that run the call together, each with the same arguments:
//   typename Acc; int rank(), size(); Acc sum(Acc): over the team, every member gets it;
//   Acc exclusive_prefix(Acc mine, Acc& total): the sum of lower ranks' values, total of all;
//   int32_t min(int32_t): over the team.
template <typename Team>
KOG_HOST_DEVICE int32_t sample_from_chunks(const Team& team, const SampleChunk* chunks, int n_chunks,
                                           const float* values, const int32_t* indices, const float* logits,
                                           int64_t vocab, float temperature, int32_t top_k, float top_p, float min_p,
                                           uint64_t seed, uint64_t counter) {
  using Acc = typename Team::Acc;
  float best = chunks[0].max, lowest = chunks[0].lowest, tau = chunks[0].cutoff;
  int32_t arg = chunks[0].arg;
  bool overflow = false;
  for (int c = 0; c < n_chunks; ++c) {
    if (chunks[c].max > best) best = chunks[c].max, arg = chunks[c].arg;  // the first chunk on ties
    lowest = fminf(lowest, chunks[c].lowest);
    tau = fmaxf(tau, chunks[c].cutoff);
    overflow |= chunks[c].n_cand < 0;
  }
  if (!(temperature > 0.f) || !(lowest <= best)) return arg;
  const float inv_temp = 1.f / temperature;
  const int slots = n_chunks * kSampleCandidateSlots;
  auto weight = [&](float x) { return Acc(expf((x - best) * inv_temp)); };
  auto kept_slot = [&](int i, float t) {
    return i % kSampleCandidateSlots < chunks[i / kSampleCandidateSlots].n_cand && values[i] >= t;
  };
  auto measure = [&](float t, bool mass) {  // count or mass of the row's logits >= t, for t >= tau
    Acc s = Acc(0);
    for (int i = team.rank(); i < slots; i += team.size())
      if (kept_slot(i, t)) s += mass ? weight(values[i]) : Acc(1);
    return team.sum(s);
  };
  auto row_mass = [&]() {  // every logit's weight, from the chunks' masses
    Acc s = Acc(0);
    for (int c = 0; c < n_chunks; ++c) s += Acc(chunks[c].mass) * weight(chunks[c].max);
    return s;
  };
  // ops/sample.h's bisection: the largest midpoint of [lo, hi] whose measure reaches target.
  auto bisect = [&](float lo, float hi, Acc target, bool mass, float& result) {
    if (overflow) return false;
    const Acc at_tau = measure(tau, mass);
    for (int it = 0; it < kSampleMaxHalvings && hi > lo; ++it) {
      const float mid = 0.5f * (lo + hi);
      if (mid <= lo || mid >= hi) break;
      bool reached = true;
      if (mid >= tau) reached = measure(mid, mass) >= target;
      else if (!(at_tau >= target)) return false;  // below tau and not decided by M(tau)
      if (reached) lo = mid;
      else hi = mid;
    }
    result = lo;
    return true;
  };

  float lo = lowest;
  if (top_k > 0 && top_k < vocab && !bisect(lowest, best, Acc(top_k), false, lo)) return kSampleFallback;
  if (min_p > 0.f) lo = fmaxf(lo, best + logf(min_p) * temperature);
  if (top_p < 1.f) {
    Acc total;
    if (lo <= lowest) total = row_mass();
    else if (lo >= tau && !overflow) total = measure(lo, true);
    else return kSampleFallback;
    if (!bisect(lo, best, Acc(top_p) * total, true, lo)) return kSampleFallback;
  }
  lo = fminf(lo, best);

  // The draw: u in [0, kept mass), the first index in row order whose running mass passes it.
  // Each member takes a contiguous range of what is scanned; a prefix over members finds the
  // member holding u.
  auto lesser = [](int a, int b) { return a < b ? a : b; };
  const int32_t none = INT32_MAX;
  int32_t token = none;
  if (lo > lowest && lo >= tau) {  // candidates only
    if (overflow) return kSampleFallback;
    const int per = (slots + team.size() - 1) / team.size();
    const int r0 = lesser(slots, team.rank() * per), r1 = lesser(slots, r0 + per);
    Acc mine = Acc(0), total = Acc(0);
    for (int i = r0; i < r1; ++i)
      if (kept_slot(i, lo)) mine += weight(values[i]);
    Acc run = team.exclusive_prefix(mine, total);
    const Acc u = Acc(uniform01(seed, counter)) * total;
    if (mine > Acc(0) && u >= run && u < run + mine)
      for (int i = r0; i < r1; ++i) {
        if (!kept_slot(i, lo)) continue;
        run += weight(values[i]);
        if (u < run) {
          token = indices[i];
          break;
        }
      }
  } else if (lo <= lowest) {  // the whole row: find u's chunk, then scan it
    const Acc u = Acc(uniform01(seed, counter)) * row_mass();
    Acc before = Acc(0);
    int c = 0;
    for (; c < n_chunks; ++c) {
      const Acc m = Acc(chunks[c].mass) * weight(chunks[c].max);
      if (u < before + m) break;
      before += m;
    }
    if (c == n_chunks) return arg;  // rounding put u past the end
    const int64_t begin = int64_t(c) * kSampleChunk;
    const int n = int(vocab - begin < kSampleChunk ? vocab - begin : kSampleChunk);
    const int per = (n + team.size() - 1) / team.size();
    const int r0 = lesser(n, team.rank() * per), r1 = lesser(n, r0 + per);
    Acc mine = Acc(0), total = Acc(0);
    for (int v = r0; v < r1; ++v) mine += weight(logits[begin + v]);
    Acc run = before + team.exclusive_prefix(mine, total);
    if (mine > Acc(0) && u >= run && u < run + mine)
      for (int v = r0; v < r1; ++v) {
        run += weight(logits[begin + v]);
        if (u < run) {
          token = int32_t(begin + v);
          break;
        }
      }
  } else {
    return kSampleFallback;
  }
  token = team.min(token);
  return token == none ? arg : token;
}

// The host's team: one member (the CPU reference of the GPU's workgroup).
struct SerialTeam {
  using Acc = double;
  int rank() const { return 0; }
  int size() const { return 1; }
  Acc sum(Acc v) const { return v; }
  Acc exclusive_prefix(Acc mine, Acc& total) const { return total = mine, Acc(0); }
  int32_t min(int32_t v) const { return v; }
};

}  // namespace kog
