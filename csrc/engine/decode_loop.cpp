// The native multi-token decode loop. Contract: decode_loop.h.
#include "engine/decode_loop.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "common/errors.h"
#include "cpu/kernels.h"

namespace kog::engine {

void sample_sequences(float* logits, int64_t batch, int64_t vocab, SequenceSampling* const* rows,
                      int32_t* tokens) {
  thread_local std::vector<float> scratch;
  thread_local std::vector<SampleRowParams> params;
  scratch.resize(size_t(vocab));
  params.resize(size_t(batch));
  for (int64_t b = 0; b < batch; ++b) {
    KOG_CHECK(rows[b] != nullptr, "sample: row ", b, " has no sampling state");
    params[size_t(b)] = rows[b]->row();
  }
  SampleParams p{logits, batch, vocab, params.data(), tokens, scratch.data()};
  cpu::kernels().sample(p);
}

// A row whose draw is the argmax of its raw logits: greedy, nothing banned, no penalty.
static bool plain_greedy(const SampleRowParams& r) {
  return !(r.temperature > 0.f) && r.n_banned == 0 && r.repetition_penalty == 1.f && r.presence_penalty == 0.f &&
         r.frequency_penalty == 0.f;
}

DecodeLoop::DecodeLoop(DecodeExecutor& executor, int64_t vocab, int64_t block_size)
    : ex_(executor), vocab_(vocab), block_size_(block_size) {
  KOG_CHECK(vocab_ > 0 && block_size_ > 0, "decode loop: bad vocab / block size");
}

void DecodeLoop::validate(const LoopBatch& b) const {
  KOG_CHECK(b.batch >= 1 && b.n_steps >= 1, "decode loop: batch ", b.batch, " and n_steps ", b.n_steps,
            " must be >= 1");
  KOG_CHECK(b.tokens && b.positions && b.block_tables && b.rows && b.out_tokens && b.n_new && b.finish,
            "decode loop: null input");
  std::unordered_set<const SequenceSampling*> seen;
  for (int64_t r = 0; r < b.batch; ++r) {
    KOG_CHECK(b.rows[r] != nullptr && seen.insert(b.rows[r]).second, "decode loop: row ", r,
              " has no sampling state or shares another row's");
    const SamplingConfig& cfg = b.rows[r]->config();
    const int64_t room = cfg.max_output - b.rows[r]->n_output();  // tokens the row may still output
    KOG_CHECK(room >= 1, "decode loop: row ", r, " has output its max_output ", cfg.max_output, " tokens");
    const int64_t last = b.positions[r] + std::min(b.n_steps, room);  // tokens cached after its last step
    KOG_CHECK(b.positions[r] >= 0 && last <= b.max_blocks * block_size_, "decode loop: row ", r, " needs ", last,
              " tokens of cache, its block table holds ", b.max_blocks * block_size_);
    const int32_t* table = b.block_tables + r * b.max_blocks;
    for (int64_t i = 0; i < (last + block_size_ - 1) / block_size_; ++i)
      KOG_CHECK(table[i] >= 0, "decode loop: block_tables[", r, ", ", i, "] = ", table[i], " is not a block");
  }
}

void DecodeLoop::run(const LoopBatch& b) {
  validate(b);
  const int64_t B = b.batch, mb = b.max_blocks;
  for (int64_t i = 0; i < b.n_steps * B; ++i) b.out_tokens[i] = -1;
  for (int64_t r = 0; r < B; ++r) b.n_new[r] = 0, b.finish[r] = int32_t(Finish::kNone);
  active_.resize(size_t(B));
  tokens_.resize(size_t(B));
  positions_.resize(size_t(B));
  for (int64_t r = 0; r < B; ++r) active_[size_t(r)] = r, tokens_[size_t(r)] = b.tokens[r], positions_[size_t(r)] = b.positions[r];
  std::vector<SequenceSampling*> rows(static_cast<size_t>(B));
  std::vector<int32_t> sampled(static_cast<size_t>(B));
  std::vector<int64_t> argmax(static_cast<size_t>(B));

  for (int64_t step = 0; step < b.n_steps && !active_.empty(); ++step) {
    const int64_t n = int64_t(active_.size());
    seq_lens_.resize(size_t(n));
    slots_.resize(size_t(n));
    tables_.resize(size_t(n * mb));
    logits_.resize(size_t(n * vocab_));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = active_[size_t(i)], pos = positions_[size_t(i)];
      const int32_t* table = b.block_tables + r * mb;
      std::memcpy(&tables_[size_t(i * mb)], table, size_t(mb) * sizeof(int32_t));
      seq_lens_[size_t(i)] = int32_t(pos + 1);
      slots_[size_t(i)] = int64_t(table[pos / block_size_]) * block_size_ + pos % block_size_;
      rows[size_t(i)] = b.rows[r];
    }
    // Every row plain greedy: the executor's argmax is the draw (on a tensor-parallel rank, a
    // distributed one: no logits exchanged). Every rank decides alike (equal sampling states).
    bool argmax_only = true;
    for (int64_t i = 0; i < n && argmax_only; ++i) argmax_only = plain_greedy(rows[size_t(i)]->row());
    ex_.run(DecodeStep{n, tokens_.data(), positions_.data(), tables_.data(), mb, seq_lens_.data(), slots_.data(),
                       logits_.data(), argmax_only ? argmax.data() : nullptr, argmax_only});
    if (argmax_only) {
      for (int64_t i = 0; i < n; ++i) sampled[size_t(i)] = int32_t(argmax[size_t(i)]);
    } else {
      sample_sequences(logits_.data(), n, vocab_, rows.data(), sampled.data());
    }
    int64_t kept = 0;  // compaction of the rows still going
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = active_[size_t(i)];
      const int32_t token = sampled[size_t(i)];
      b.rows[r]->add_output(token);
      b.out_tokens[step * B + r] = token;
      b.n_new[r] += 1;
      const Finish f = b.rows[r]->finish_after(token);
      b.finish[r] = int32_t(f);
      if (f != Finish::kNone) continue;
      active_[size_t(kept)] = r;
      tokens_[size_t(kept)] = token;
      positions_[size_t(kept)] = positions_[size_t(i)] + 1;
      ++kept;
    }
    active_.resize(size_t(kept));
  }
}

}  // namespace kog::engine
