// One sequence's native sampling state. Contract: sequence_sampling.h.
#include "engine/sequence_sampling.h"

#include <algorithm>
#include <cmath>

#include "common/errors.h"

namespace kog::engine {

SequenceSampling::SequenceSampling(SamplingConfig cfg, int64_t vocab, const int32_t* prompt, int64_t n_prompt)
    : cfg_(std::move(cfg)), vocab_(vocab) {
  KOG_CHECK(vocab_ > 0, "sampling: vocab must be > 0");
  KOG_CHECK(std::isfinite(cfg_.temperature) && cfg_.temperature >= 0.f, "sampling: bad temperature ", cfg_.temperature);
  KOG_CHECK(cfg_.top_p > 0.f && cfg_.top_p <= 1.f, "sampling: top_p must be in (0, 1], got ", cfg_.top_p);
  KOG_CHECK(cfg_.min_p >= 0.f && cfg_.min_p <= 1.f, "sampling: min_p must be in [0, 1], got ", cfg_.min_p);
  KOG_CHECK(cfg_.repetition_penalty > 0.f, "sampling: repetition_penalty must be > 0");
  KOG_CHECK(cfg_.min_tokens >= 0 && cfg_.max_output >= 1, "sampling: bad min_tokens / max_output");
  for (const auto* ids : {&cfg_.stop_ids, &cfg_.banned_ids})
    for (int32_t t : *ids) KOG_CHECK(t >= 0, "sampling: negative stop id ", t);
  track_seen_ = cfg_.repetition_penalty != 1.f;
  track_counts_ = cfg_.presence_penalty != 0.f || cfg_.frequency_penalty != 0.f;
  if (track_seen_) seen_flag_.assign(size_t(vocab_), 0);
  if (track_counts_) count_index_.assign(size_t(vocab_), -1);
  for (int64_t i = 0; i < n_prompt; ++i) {
    KOG_CHECK(prompt[i] >= 0 && prompt[i] < vocab_, "sampling: prompt id ", prompt[i], " outside the vocabulary");
    if (track_seen_) see(prompt[i]);
  }
}

void SequenceSampling::see(int32_t token) {
  if (!seen_flag_[size_t(token)]) {
    seen_flag_[size_t(token)] = 1;
    seen_ids_.push_back(token);
  }
}

void SequenceSampling::add_output(int32_t token) {
  KOG_CHECK(token >= 0 && token < vocab_, "sampling: token ", token, " outside the vocabulary of ", vocab_);
  if (track_seen_) see(token);
  if (track_counts_) {
    int32_t& at = count_index_[size_t(token)];
    if (at < 0) {
      at = int32_t(output_ids_.size());
      output_ids_.push_back(token);
      output_counts_.push_back(0);
    }
    ++output_counts_[size_t(at)];
  }
  ++n_output_;
}

Finish SequenceSampling::finish_after(int32_t token) const {
  const auto& s = cfg_.stop_ids;
  if (n_output_ >= cfg_.min_tokens && std::find(s.begin(), s.end(), token) != s.end()) return Finish::kStop;
  if (n_output_ >= cfg_.max_output) return Finish::kLength;
  return Finish::kNone;
}

SampleRowParams SequenceSampling::row() const {
  SampleRowParams r{};
  r.temperature = cfg_.temperature;
  r.top_k = cfg_.top_k;
  r.top_p = cfg_.top_p;
  r.min_p = cfg_.min_p;
  r.seed = cfg_.seed;
  r.counter = uint64_t(n_output_);
  r.repetition_penalty = cfg_.repetition_penalty;
  r.presence_penalty = cfg_.presence_penalty;
  r.frequency_penalty = cfg_.frequency_penalty;
  r.seen_ids = seen_ids_.data();
  r.n_seen = int64_t(seen_ids_.size());
  r.output_ids = output_ids_.data();
  r.output_counts = output_counts_.data();
  r.n_output_ids = int64_t(output_ids_.size());
  if (n_output_ < cfg_.min_tokens) {
    r.banned_ids = cfg_.banned_ids.data();
    r.n_banned = int64_t(cfg_.banned_ids.size());
  }
  return r;
}

}  // namespace kog::engine
