// One sequence's native sampling state: its request's sampling config, the counts its
// penalties read (kept incrementally: O(1) per token, never rebuilt from the context), and the
// number of tokens it has output, which is also the counter of its next draw. So a sampled
// token depends only on (logits, config, seed, output index): one decode step per call and a
// K-step loop (csrc/engine/decode_loop.h) draw the same tokens.
#pragma once
#include <cstdint>
#include <vector>

#include "ops/sample.h"

namespace kog::engine {

enum class Finish : int32_t { kNone = 0, kStop = 1, kLength = 2 };

struct SamplingConfig {
  float temperature = 0.f;        // <= 0: greedy
  int32_t top_k = 0;              // <= 0: off
  float top_p = 1.f;
  float min_p = 0.f;
  uint64_t seed = 0;
  float repetition_penalty = 1.f;
  float presence_penalty = 0.f;
  float frequency_penalty = 0.f;
  int64_t min_tokens = 0;         // banned_ids are masked and stop_ids ignored before this many tokens
  int64_t max_output = INT64_MAX; // finish "length" once this many tokens are out
  std::vector<int32_t> stop_ids;  // finish "stop" (EOS unless ignore_eos, stop_token_ids)
  std::vector<int32_t> banned_ids;  // masked before min_tokens (EOS and stop_token_ids)
};

class SequenceSampling {
 public:
  // prompt: [n_prompt] ids; counted only when a repetition penalty needs them.
  SequenceSampling(SamplingConfig cfg, int64_t vocab, const int32_t* prompt, int64_t n_prompt);

  // Records an output token: counts, n_output + 1. Throws kInvalidArgument outside the vocabulary.
  void add_output(int32_t token);
  // The finish reason after `token` became output token n_output() - 1 (the engine's stop rules).
  Finish finish_after(int32_t token) const;
  // The sampling kernel's row for the next draw (pointers into this object: valid until the
  // next add_output).
  SampleRowParams row() const;

  int64_t n_output() const { return n_output_; }
  const SamplingConfig& config() const { return cfg_; }
  bool greedy() const { return !(cfg_.temperature > 0.f); }

 private:
  void see(int32_t token);

  SamplingConfig cfg_;
  int64_t vocab_;
  int64_t n_output_ = 0;
  bool track_seen_, track_counts_;
  std::vector<uint8_t> seen_flag_;     // [vocab] when track_seen_
  std::vector<int32_t> seen_ids_;      // distinct prompt + output ids
  std::vector<int32_t> count_index_;   // [vocab] index into output_ids_, -1; when track_counts_
  std::vector<int32_t> output_ids_;    // distinct output ids
  std::vector<int32_t> output_counts_; // their counts
};

}  // namespace kog::engine
