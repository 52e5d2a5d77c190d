// The native multi-token decode loop on the CPU: one call runs up to n_steps decode steps of a
// batch, each step = DecodeExecutor::run over the rows still going, the native sampler
// (csrc/ops/sample.h, per-sequence state in sequence_sampling.h), then the stop-token and
// max-token checks. A sampled token is the next step's input; positions advance by one and
// slots come from the block tables, which the caller has filled beforehand for the tokens each
// row may still compute (the engine reserves the blocks). A finished row leaves the batch.
//
//   DecodeLoop loop(executor, block_size);
//   loop.run(batch);    // out_tokens [n_steps, B], n_new [B], finish [B]
//
// Tokens equal those of n_steps calls with n_steps = 1: a draw depends only on the row's
// (logits, config, seed, output index), never on the batch or on where a call starts.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/decode_executor.h"
#include "engine/sequence_sampling.h"

namespace kog::engine {

struct LoopBatch {
  int64_t batch;                   // B >= 1
  int64_t n_steps;                 // K >= 1
  const int64_t* tokens;           // [B] each row's newest token (its KV not yet cached)
  const int64_t* positions;        // [B] that token's position (= tokens cached)
  const int32_t* block_tables;     // [B, max_blocks] row-major, covering positions + min(K, the
                                   // row's max_output - n_output) tokens
  int64_t max_blocks;
  SequenceSampling* const* rows;   // [B] distinct; each advances by the tokens it samples
  int64_t* out_tokens;             // [K, B] out: step s's token of row b; -1 once b finished
  int32_t* n_new;                  // [B] out: tokens sampled per row (1..K)
  int32_t* finish;                 // [B] out: Finish after the row's last token
};

class DecodeLoop {
 public:
  // The executor outlives the loop (the binding keeps it alive).
  DecodeLoop(DecodeExecutor& executor, int64_t vocab, int64_t block_size);

  // Runs the loop; validates everything first (throws kInvalidArgument having run nothing).
  void run(const LoopBatch& b);

 private:
  void validate(const LoopBatch& b) const;

  DecodeExecutor& ex_;
  int64_t vocab_;
  int64_t block_size_;
  // Step arrays of the active rows, compacted: [active].
  std::vector<int64_t> tokens_, positions_, slots_;
  std::vector<int32_t> seq_lens_, tables_;
  std::vector<int64_t> active_;    // active step row -> batch row
  std::vector<float> logits_;      // [active, vocab] f32
};

// One token per row from f32 logits [batch, vocab] (modified in place by penalties and bans),
// each row's draw at counter = its n_output; the rows' state is not advanced (add_output does).
void sample_sequences(float* logits, int64_t batch, int64_t vocab, SequenceSampling* const* rows,
                      int32_t* tokens);

}  // namespace kog::engine
