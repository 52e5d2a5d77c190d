// The CPU decode executor: runs the decode instruction schedule (csrc/schedule/opcodes.h, built
// by kog/schedule.py) for a whole batch in one call, every instruction on the CPU kernel table.
// Built once per model; keeps a workspace arena of activation buffers that grows with the batch.
//
//   DecodeExecutor ex(dims, kv, inv_freq, instructions);   // weight pointers baked in
//   ex.run(step);                                          // logits [batch, vocab] f32
//
// The executor does not own weights or the KV cache: the caller keeps them alive and in place.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "common/dtype.h"
#include "cpu/row_queue.h"
#include "ops/linear.h"
#include "schedule/opcodes.h"

namespace kog::engine {

using schedule::Buffer;
using schedule::Opcode;

struct ModelDims {
  int64_t n_layers;
  int64_t hidden;
  int64_t n_q_heads;
  int64_t n_kv_heads;     // divides n_q_heads
  int64_t head_dim;
  int64_t intermediate;
  int64_t vocab;
  int64_t rotary_dim;     // 2 * len(inv_freq), <= head_dim
  float rms_eps;
  float attn_scale;       // softmax scale, usually head_dim^-0.5
  bool rope_neox;
  DType dtype;            // run dtype of weights, activations and the KV cache (f32/f16/bf16)
};

struct KVCacheDesc {
  void* base;             // [n_layers, num_blocks, 2, n_kv_heads, block_size, head_dim] dtype, contiguous
  int64_t num_blocks;
  int64_t block_size;
};

// One schedule instruction with its operands resolved. Buffers not used are -1.
struct Instruction {
  Opcode op;
  int32_t layer;          // -1 for model-level instructions
  int32_t in;             // Buffer read (RMS_NORM: x; LINEAR: x; ...)
  int32_t residual;       // RMS_NORM only: the residual stream it adds x to and normalizes
  int32_t out;            // Buffer written
  const void* w0;         // weight (EMBED: [vocab, hidden]; LINEAR: [n, k]; norms: [width]; QK_NORM: q_norm)
  const void* w1;         // LINEAR: bias [n] or null; QK_NORM: k_norm [head_dim]
};

struct DecodeStep {
  int64_t batch;                // B >= 1
  const int64_t* tokens;        // [B] input token ids
  const int64_t* positions;     // [B] tokens already cached = position of the new token
  const int32_t* block_tables;  // [B, max_blocks] row-major, padded
  int64_t max_blocks;
  const int32_t* seq_lens;      // [B] = positions + 1
  const int64_t* slots;         // [B] cache slot of the new token
  float* logits;                // [B, vocab] f32 output
  int64_t* sampled;             // [B] greedy tokens (SAMPLE), or null to skip
};

class DecodeExecutor {
 public:
  DecodeExecutor(const ModelDims& dims, const KVCacheDesc& kv, std::vector<float> inv_freq,
                 std::vector<Instruction> program);

  // Runs instructions [0, stop_after) (all when stop_after < 0); validates the step first and
  // throws kog::Error(kInvalidArgument) naming the first bad index, having run nothing.
  // Thread-safe: concurrent calls are serialized (they share the arena and the cache).
  void run(const DecodeStep& step, int64_t stop_after = -1);

  // Copies buffer b ([B, width] in the run dtype; LOGITS: f32) of the last run into dst.
  void read_buffer(Buffer b, void* dst, int64_t nbytes) const;
  int64_t width(Buffer b) const;
  int64_t num_instructions() const { return int64_t(program_.size()); }

 private:
  void validate(const DecodeStep& s) const;
  void reserve(int64_t batch);
  char* buf(int32_t b) const { return base_[b]; }
  void exec(const Instruction& ins, const DecodeStep& s);
  void embed(const Instruction& ins, const DecodeStep& s);
  void rmsnorm(const Instruction& ins, int64_t batch);
  void qk_norm(const Instruction& ins, int64_t batch);
  // LINEAR as thread `part` of the region's team, rows from row_queue_ (epoch: see run).
  void linear_part(const Instruction& ins, int64_t batch, uint32_t epoch, int part);
  LinearParams linear_params(const Instruction& ins, int64_t batch);
  // Instructions that run outside the step's parallel region (long-context attention).
  bool runs_alone(const Instruction& ins) const;
  void attention(const Instruction& ins, const DecodeStep& s);
  void sample(const DecodeStep& s);

  ModelDims d_;
  KVCacheDesc kv_;
  std::vector<float> inv_freq_;
  std::vector<Instruction> program_;
  int64_t elem_;            // bytes per activation element
  int64_t qkv_width_;
  int64_t layer_stride_;    // elements of one layer's cache
  int64_t capacity_ = 0;    // batch the arena is sized for
  int64_t batch_ = 0;       // batch of the last run
  int64_t max_seq_len_ = 0;
  std::vector<char> arena_;
  std::vector<float> scratch_;  // linear: [threads, B, max k] f32, one slice per thread
  int64_t scratch_stride_ = 0;  // B * max k
  std::unique_ptr<cpu::RowQueue> row_queue_;  // sized to the region's team
  uint32_t epoch_base_ = 0;     // + instruction index = a LINEAR's row-queue epoch
  char* base_[int(Buffer::kNumBuffers)] = {};
  std::mutex mu_;
};

}  // namespace kog::engine
