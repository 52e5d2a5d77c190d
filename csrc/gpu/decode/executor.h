// Host side of the GPU persistent decode kernel: plain C++ (no vendor types), so the bindings
// compile the same in every build. Implemented in persistent_decode.cu (cuda/rocm builds).
//
//   GpuDecodeExecutor ex(dims, kv, inv_freq_device, ops);   // once per model
//   ex.run(step, stream);                                    // one launch: n_steps whole steps
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/decode/params.h"

namespace kog::gpu::decode {

using schedule::KVCacheDesc;

// One step's inputs and outputs, all device pointers (the caller keeps them alive until the
// launch completes on `stream`).
struct GpuDecodeStep {
  int32_t batch;                 // 1..kMaxBatch
  int32_t n_steps;               // 1..kMaxLoopSteps
  int32_t* tokens;               // [B] int32 in: the newest tokens; out: the last sampled ones
  int64_t* positions;            // [B] in/out (advanced on the device between loop steps)
  int32_t* seq_lens;             // [B] in/out: positions + 1
  int64_t* slots;                // [B] in/out
  const int32_t* block_tables;   // [B, max_blocks], covering positions + n_steps tokens
  int32_t max_blocks;
  int32_t max_seq_len;           // max(seq_lens) after the last step: sizes the attention split
  const SamplingRow* sampling;   // [B]
  uint64_t rng_step;             // counter of the first step (draws of step s use rng_step + s)
  const int32_t* stop_ids;       // [n_stop_ids] (loop mode), may be null when 0
  int32_t n_stop_ids;
  int32_t* out_tokens;           // [n_steps, B]
  int32_t* finished;             // [B] in/out
  float* logits;                 // [B, vocab] f32: the last step's logits (the sample partial's copy of LOGITS)
};

class GpuDecodeExecutor {
 public:
  static constexpr int kMaxBatch = 8;       // == tuning.cuh kMaxBatch
  static constexpr int kMaxLoopSteps = 64;

  // ops: the expanded program (schedule::expand_gpu_program) with device weight pointers; inv_freq: device
  // [rotary_dim / 2] f32. Allocates the activation arena on the current device (widths:
  // schedule::buffer_width, the same as the CPU executor's).
  GpuDecodeExecutor(const ModelDims& dims, const KVCacheDesc& kv, const float* inv_freq,
                    const std::vector<Op>& ops);
  ~GpuDecodeExecutor();
  GpuDecodeExecutor(const GpuDecodeExecutor&) = delete;
  GpuDecodeExecutor& operator=(const GpuDecodeExecutor&) = delete;

  // Validates the step (shapes only: device data is not read) and enqueues ONE launch.
  void run(const GpuDecodeStep& step, void* stream);

  int grid_size() const { return grid_; }
  int64_t num_ops() const { return int64_t(n_ops_); }

  // The watchdog of the kernel's dependency waits: a wait longer than this traps, recording
  // where (wait_timeout()). Default kDefaultWaitTimeoutMs; 0 waits forever (a debugger, a
  // sanitizer's slowed run).
  static constexpr double kDefaultWaitTimeoutMs = 2000.0;
  void set_wait_timeout_ms(double ms);
  // What the first timed-out wait recorded (fired == 0: none). Host memory: readable after the
  // trap has killed the launch.
  WaitTimeout wait_timeout() const;
  // Tests: the items of op `op` (expanded index) of step 0 never signal (-1: off), so a wait on
  // it times out.
  void set_debug_skip_signal_op(int32_t op) { debug_skip_signal_op_ = op; }

  // Tensor parallelism (dims.lane_ranks > 1; rank_items.cuh). Each rank allocates an inbox of
  // inbox_bytes() and flag_count() zeroed uint64 flags in device memory another rank's kernel can
  // store into (CUDA / HIP IPC, or one device), and gives every rank's executor every rank's two
  // addresses as that process maps them, rank order, before the first run. Each run's steps
  // count on from the last run's (the flags' epochs): every rank must run the same n_steps.
  int64_t inbox_bytes() const { return 2 * comm_.parity_bytes; }
  int64_t flag_count() const { return int64_t(comm_.part.size()) * d_.lane_ranks; }
  void set_ranks(const std::vector<uintptr_t>& inboxes, const std::vector<uintptr_t>& flags);
  // At most this many workgroups per launch (0: as many as fit): ranks sharing one device (tests)
  // must all be resident at once.
  void set_max_grid(int max_grid);

 private:
  void ensure_partials(int32_t max_parts);

  ModelDims d_;
  KVCacheDesc kv_;
  const float* inv_freq_;
  int32_t n_ops_ = 0;
  int32_t n_sinks_ = 0;
  bool quant_ = false;              // the program has FP8 / 4-bit GEMVs: the kernel instantiation with them
  Op* program_ = nullptr;           // device
  int32_t* sinks_ = nullptr;        // device [n_sinks_] (schedule::program_sinks)
  char* arena_ = nullptr;           // device: activation buffers for kMaxBatch rows
  char* buffers_[int(schedule::Buffer::kNumBuffers)] = {};
  unsigned* counters_ = nullptr;    // device [kMaxLoopSteps * n_ops + 1 + kMaxBatch * n_kv_heads] (params.h)
  float* partials_ = nullptr;       // device
  int32_t* next_linear_ = nullptr;  // device [n_ops]
  char* sample_scratch_ = nullptr;  // device: the sample partial's summaries and candidate slots
  SampleChunk* sample_summaries_ = nullptr;
  float* sample_values_ = nullptr;
  int32_t* sample_indices_ = nullptr;
  char* moe_scratch_ = nullptr;     // device: MoeScratch's arrays (mixture-of-experts models only)
  MoeScratch moe_{};                // pointers into it (route_count: set per launch, in counters_)
  int32_t partials_parts_ = 0;
  int grid_ = 0;
  WaitTimeout* timeout_host_ = nullptr;    // host-mapped (gpuHostAllocMapped)
  WaitTimeout* timeout_device_ = nullptr;  // its device address
  int64_t ticks_per_ms_ = 0;               // gpu_wall_ticks per ms on this device
  uint64_t wait_timeout_ticks_ = 0;
  int32_t debug_skip_signal_op_ = -1;
  int full_grid_ = 0;                      // workgroups that fit on the device
  schedule::CommLayout comm_;              // a rank's channels (empty on one rank)
  char* comm_arrays_ = nullptr;            // device: offsets, parts, push counts, the RankExchange
  RankExchange exchange_{};                // host: its layout pointers (set_ranks adds the ranks' memory)
  RankExchange* ranks_ = nullptr;          // device, in comm_arrays_
  bool ranks_set_ = false;
  uint64_t step_base_ = 0;                 // steps run by earlier launches (the flags' epochs)
};

// The persistent kernel's instantiations (persistent_kernel_float.cu / _quant.cu) for run dtype
// t: with the float GEMV only, and with the GEMVs over GPU weight formats (null unless bf16).
void* persistent_kernel_float(DType t);
void* persistent_kernel_quant(DType t);

}  // namespace kog::gpu::decode
