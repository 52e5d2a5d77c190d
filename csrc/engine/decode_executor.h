// The CPU decode executor: runs the model program (csrc/schedule/program.h, built by
// kog.program) for a whole batch in one call, every op on the CPU kernel table, with a barrier
// only where a dependency crosses threads (decode_executor.cpp: plan_barriers).
// Built once per model; keeps a workspace arena of activation buffers that grows with the batch.
//
//   DecodeExecutor ex(dims, kv, inv_freq, ops);   // weight pointers baked in
//   ex.run(step);                                 // logits [batch, vocab] f32
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
#include "ops/linear_quant.h"
#include "engine/shm_transport.h"
#include "schedule/program.h"

namespace kog::engine {

using schedule::Buffer;
using schedule::KVCacheDesc;
using schedule::ModelDims;
using schedule::Op;
using schedule::Opcode;

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
  // Every row greedy with nothing to adjust (no bans, no penalties): SAMPLE only writes sampled
  // (non-null) and leaves logits untouched, and a vocabulary-parallel head's ALL_GATHER
  // exchanges each row's best (logit, id) of the rank's slice instead of the slice itself
  // (argmax_gather): R x B pairs instead of B x vocab floats. The ids equal a full argmax.
  bool argmax_only = false;
};

// x stages of the quantized LINEARs (LinearQuantParams::x_stages). NOTE: 2, the residual stage
// too: with x quantized once, SmolLM2's Q4_1 logits were up to 1.6 away from the same weights
// in fp32 and greedy tokens split early on most chat prompts; with the residual, 0.035 (the
// prefill interpreter uses the same, kog.program.interpreter.QUANT_X_STAGES).
constexpr int kQuantXStages = 2;

class DecodeExecutor {
 public:
  // Validates dims and program (schedule::validate_dims / validate_program): kInvalidArgument
  // naming the bad field or op.
  DecodeExecutor(const ModelDims& dims, const KVCacheDesc& kv, std::vector<float> inv_freq,
                 std::vector<Op> program);

  // Runs ops [0, stop_after) (all when stop_after < 0); validates the step first and throws
  // kog::Error(kInvalidArgument) naming the first bad index, having run nothing.
  // Thread-safe: concurrent calls are serialized (they share the arena and the cache).
  void run(const DecodeStep& step, int64_t stop_after = -1);

  // Copies buffer b ([B, width] in the run dtype; TOKENS: int32) of the last run into dst.
  void read_buffer(Buffer b, void* dst, int64_t nbytes) const;
  int64_t width(Buffer b) const { return schedule::buffer_width(d_, int32_t(b)); }
  int64_t num_ops() const { return int64_t(program_.size()); }
  // Barriers a whole step's region places (inside the region; attention outside it aside).
  int64_t num_barriers() const;
  // LINEARs that write their output straight into the transport slot a LANE_GATHER publishes
  // (plan_zero_copy; 0 without a transport).
  int64_t num_zero_copy_publishes() const;
  // ALL_GATHERs of LOGITS run as a distributed argmax (DecodeStep::argmax_only) since construction.
  int64_t num_argmax_gathers() const { return argmax_gathers_; }
  // A tensor-parallel rank's transport (dims.lane_ranks > 1; run() refuses to start without
  // one): its lane ops and collectives reduce over every rank through it.
  void set_transport(std::shared_ptr<ShmTransport> t);

 private:
  void validate(const DecodeStep& s) const;
  void reserve(int64_t batch);
  char* buf(int32_t b) const { return base_[b]; }
  // Where op (an element of program_) writes its output / reads its input this run: the
  // transport slot part of a zero-copy publish (plan_zero_copy), else buf(op.out) / buf(op.in).
  char* out_of(const Op& op) const;
  const char* in_of(const Op& op) const;
  // A rank's LINEAR whose output a LANE_GATHER publishes next writes it into the transport's
  // slot part directly, and the lane op after the gather reads it there (writing the buffer):
  // the publish copies nothing. Set by set_transport.
  void plan_zero_copy();
  void exec(const Op& op, const DecodeStep& s);
  void embed(const Op& op, const DecodeStep& s);
  void rmsnorm(const Op& op, int64_t batch);
  void qk_norm(const Op& op, int64_t batch);
  // LINEAR as thread `part` of the region's team, rows from row_queue_ (epoch: see run).
  void linear_part(const Op& op, int64_t batch, uint32_t epoch, int part);
  LinearParams linear_params(const Op& op, int64_t batch);
  // Where a (non-lane) LINEAR writes its rows: out_of(op) and all width(out) of them, or a rank's
  // vocabulary slice of LOGITS (Op::vocab_slice): its columns of buf(LOGITS), vocab / lane_ranks.
  struct LinearOut {
    char* out;
    int64_t rows;
  };
  LinearOut linear_out(const Op& op) const;
  // A lane LINEAR (op.lanes > 1) is lane_matrices(op) matrices, one per (output segment, lane)
  // in output-row order; lane_matrix(op, batch, i) is the i-th (decode_lanes.cpp).
  int64_t lane_matrices(const Op& op) const;
  LinearParams lane_matrix(const Op& op, int64_t batch, int64_t i);
  // LANE_* ops and the collectives, on the calling thread (decode_lanes.cpp).
  void lane_op(const Op& op, int64_t batch);
  // acc [batch, n] f32 = its sum over every rank (in place; one rank: unchanged).
  void reduce_ranks(float* acc, int64_t n);
  // A LINEAR over quantized weights (w_type a QuantType); scratch: linear_quant_scratch_bytes.
  LinearQuantParams linear_quant_params(const Op& op, int64_t batch, float* scratch);
  // Ops that run outside the step's parallel region (long-context attention).
  bool runs_alone(const Op& op) const;
  void attention(const Op& op, const DecodeStep& s);
  void sample(const Op& op, const DecodeStep& s);
  // A vocabulary-parallel head's ALL_GATHER in an argmax_only step: each row's best (logit, id)
  // over the rank's slice, every rank's pair exchanged (exact), the best of them kept (ties: the
  // lower id, as a full argmax) into argmax_ for SAMPLE (decode_lanes.cpp).
  void argmax_gather(const Op& op, int64_t batch);
  // Mixture of experts (decode_moe.cpp): ROUTER and MOE_EXPERTS run inside the region on
  // every thread of the team (their GEMMs split by the row queue), route() on thread 0.
  void route_part(const Op& op, int64_t batch, uint32_t epoch, int t);
  void route(int64_t batch);
  void experts_part(const Op& op, int64_t batch, int t, int nt);
  // Bytes of one k-wide row of an expert matrix stored as w_type (run dtype or a QuantType).
  int64_t expert_row_bytes(int32_t w_type, int64_t k) const;
  // One expert GEMM's share of thread t (float or quantized weights; epoch from the row queue).
  void expert_gemm(const char* w, int32_t w_type, char* out, const char* in, int64_t m, int64_t n, int64_t k,
                   float* scratch, uint32_t epoch, int t);
  void plan_barriers();

  ModelDims d_;
  KVCacheDesc kv_;
  std::shared_ptr<ShmTransport> transport_;
  std::vector<float> lane_acc_;  // [batch, max(hidden, vocab)] f32 of the cross-rank reductions
  std::vector<int64_t> argmax_;  // [batch] ids argmax_gather found this run (argmax_ready_)
  bool argmax_ready_ = false;
  int64_t argmax_gathers_ = 0;
  std::vector<float> inv_freq_;
  std::vector<Op> program_;
  // Zero-copy publishes (plan_zero_copy), each [ops], -1 where none: publish_slot_[j] the slot
  // whose part LINEAR j writes; read_slot_[j] the slot whose part lane op j reads instead of its
  // input buffer; prefetch_slot_[j] a slot a later wait reads, prefetched before op j runs.
  std::vector<int32_t> publish_slot_, read_slot_, prefetch_slot_;
  bool zero_copy_ = false;  // this run is whole and its rows fit the slots (else the publishes copy)
  // barrier_before_[j]: the region's team meets before op j (plan_barriers).
  std::vector<char> barrier_before_;
  int64_t elem_;            // bytes per activation element
  int64_t kv_elem_;         // bytes per KV cache element (kv_.dtype)
  int64_t qkv_width_;
  int64_t layer_stride_;    // elements of one layer's cache
  int64_t capacity_ = 0;    // batch the arena is sized for
  int64_t batch_ = 0;       // batch of the last run
  int64_t max_seq_len_ = 0;
  std::vector<char> arena_;
  std::vector<float> scratch_;  // linear: [threads, B, max k] f32, one slice per thread
  int64_t scratch_stride_ = 0;  // B * max k
  std::unique_ptr<cpu::RowQueue> row_queue_;  // sized to the region's team
  uint32_t epoch_base_ = 0;     // + op_epoch_[op] = a LINEAR's (first) row-queue epoch
  std::vector<uint32_t> op_epoch_;  // [ops] first epoch of each op within a step
  uint32_t program_epochs_ = 0;     // epochs the ops take per step (a lane LINEAR: one per matrix)
  uint32_t moe_epochs_ = 0;     // epochs the step's expert GEMMs took, after the ops' (+ program_epochs_)
  std::vector<int64_t> moe_start_;  // [E + 1] first sorted pair of each expert (experts_part)
  char* base_[int(Buffer::kNumBuffers)] = {};
  // MoE scratch, sized by reserve() (empty in a dense model): run dtype rows for the router
  // logits [B, n_experts] and one expert's rows: x [B, hidden], gate_up [B, 2 Ie], act [B, Ie],
  // y [B, hidden]; the f32 sum over a row's experts [B, hidden]; (row, slot) pairs by expert [B top_k].
  std::vector<char> moe_rows_;
  std::vector<float> moe_acc_;
  std::vector<int32_t> moe_order_;
  std::mutex mu_;
};

}  // namespace kog::engine
