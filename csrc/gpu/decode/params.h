// Parameters of the GPU persistent decode kernel (persistent_kernel.cuh): plain C++, shared by
// the host launcher and the device code. One launch runs n_steps whole decode steps of a batch.
#pragma once
#include <cstdint>

#include "common/dtype.h"
#include "schedule/gpu_program.h"
#include "ops/sample_chunks.h"
#include "schedule/sampling_row.h"

namespace kog::gpu::decode {

using schedule::kOpLinearRopeKv;
using schedule::kOpLinearSiluMul;
using schedule::kOpLinearSamplePartial;
using schedule::ModelDims;
using schedule::Op;
using schedule::SamplingRow;

// What a timed-out dependency wait records, in host-mapped memory (readable after the trap that
// follows kills the launch and its context). The first wait to time out writes it.
struct WaitTimeout {
  int32_t fired;    // 1 once a wait timed out
  int32_t block;    // the workgroup that waited
  int32_t step;     // loop step of the op it waited for
  int32_t op;       // the op it waited for (index into the expanded program)
  uint32_t count;   // that op's completed items when the wait gave up
  uint32_t target;  // the items it waited for (the op's item count)
};

// One mixture-of-experts layer's intermediates (schedule/moe_route.h: pairs, sorted order,
// groups), device memory reused by every MoE layer: the layers' ops form a chain
// (expand_gpu_program), so one layer's router tail runs after the previous layer's combine.
// P = kMaxBatch * moe_slots(dims) pairs at most. Null in a dense model.
struct MoeScratch {
  void* logits;            // [kMaxBatch, router_rows] run dtype: the router GEMV's output
  void* x;                 // [P, hidden] run dtype: sorted pair q's row of the router's input
  void* act;               // [P, expert_intermediate] run dtype: silu(gate) * up per sorted pair
  void* y;                 // [P, hidden] run dtype: the expert's down output per sorted pair
  int32_t* n_groups;       // [1] experts chosen by the batch
  int32_t* group_expert;   // [P] group g's expert's index in the stacks (-1: another rank's expert;
                           // groups in ascending expert order)
  int32_t* group_start;    // [P + 1] group g's pairs are sorted positions [start[g], start[g + 1])
  int32_t* pair_row;       // [P] batch row of sorted pair q
  float* pair_weight;      // [P] routing weight of sorted pair q
  int32_t* row_pairs;      // [kMaxBatch, moe_slots] sorted positions of row b's pairs, ascending expert;
                           // -1: a pair of another rank's expert (expert parallelism)
  const int32_t* expert_local;  // [n_experts + shared_slots] or null (every expert here): expert e's
                                // index in this rank's stacks, -1 where another rank runs it
  unsigned* route_count;   // [1] router items done; the last routes and resets it to 0
};

// Most tensor-parallel ranks one kernel exchanges with.
constexpr int kMaxRanks = 8;

// A tensor-parallel rank's view of every rank's inbox and flags (dims.lane_ranks > 1;
// rank_items.cuh has the layouts): device memory, filled by GpuDecodeExecutor::set_ranks.
struct RankExchange {
  char* inbox[kMaxRanks];       // [lane_ranks] rank q's inbox as this process maps it: [2 parities][parity_bytes]
  uint64_t* flags[kMaxRanks];   // [lane_ranks] rank q's flags: [channels][lane_ranks] epochs (zero at first)
  const int64_t* offset;        // [channels] a channel's rank-0 part within a parity (schedule::comm_layout)
  const int64_t* part;          // [channels] bytes of one rank's part of the channel
  int64_t parity_bytes;
  unsigned* push_counts;        // [channels] this rank's items of the channel's push done (the last resets it)
};

struct PersistentDecodeParams {
  const Op* program;           // [n_ops] device memory: the expanded program (gpu_program.h)
  int32_t n_ops;
  const int32_t* step_sinks;   // [n_sinks] device: ops nothing later in the step depends on
  int32_t n_sinks;
  const int32_t* next_linear;  // [n_ops] device: the first staged GEMV op (schedule::is_staged_gemv) at or after each op (n_ops: none)
  int32_t batch;               // B, 1..kMaxBatch
  int32_t n_steps;             // decode steps run in this launch (>= 1): loop mode when > 1

  ModelDims dims;              // the model (schedule/program.h; buffer widths: buffer_width)
  const float* inv_freq;       // [rotary_dim / 2] device

  // activations: buffers[b] is [B, buffer_width(b)] in dtype (LOGITS too); TOKENS is int32 [B]
  char* buffers[int(schedule::Buffer::kNumBuffers)];
  float* logits_out;           // [B, vocab] f32: the sample partial converts LOGITS rows into it
  // the LM head's tails' output, SAMPLE's input (ops/sample_chunks.h); chunks = sample_chunks(vocab)
  SampleChunk* sample_summaries;  // [B, chunks]
  float* sample_values;        // [B, chunks, kSampleCandidateSlots] candidate logits, row order
  int32_t* sample_indices;     // [B, chunks, kSampleCandidateSlots] their ids
  float* attn_partials;        // [B, n_q_heads, max_parts, head_dim + 2] f32 (acc..., max, sum)
  int32_t max_parts;           // context partitions per sequence, sized for the last step
  int32_t attn_partition;      // cached tokens per attention item this launch (power of two)

  // KV cache: [n_layers, num_blocks, 2, n_kv_heads, block_size, head_dim] dtype
  void* kv_base;
  int64_t num_blocks;
  int32_t block_size;

  // step state (device), advanced on the device between steps in loop mode
  int64_t* positions;          // [B] position of the token being decoded
  int32_t* seq_lens;           // [B] positions + 1
  int64_t* slots;              // [B] cache slot of that token
  const int32_t* block_tables; // [B, max_blocks]; covers positions + n_steps tokens
  int32_t max_blocks;

  // sampling (device)
  const SamplingRow* sampling; // [B]
  uint64_t rng_step;           // counter of the first step of this launch
  const int32_t* stop_ids;     // [n_stop_ids] ids that finish a sequence (loop mode)
  int32_t n_stop_ids;
  int32_t* out_tokens;         // [n_steps, B] sampled ids
  int32_t* finished;           // [B] in/out: 1 once a sequence sampled a stop id; later steps skip it

  // synchronization (device, zero before the first launch; the kernel leaves them zero)
  unsigned* counters;          // [n_steps * n_ops] workgroups done with all their items of the op
  unsigned* exit_count;        // [1] blocks that finished this launch
  unsigned* attn_group_counts; // [kMaxBatch * n_kv_heads] partial items of (sequence, KV head) done in the
                               // running attention op; its last item combines and resets it to 0
  unsigned* sample_chunk_counts; // [sample_chunks(vocab)] LM-head items of the chunk done; the last summarizes
                                 // the chunk for every sequence and resets it to 0
  MoeScratch moe;              // mixture-of-experts layers only
  // watchdog: a wait longer than wait_timeout_ticks (gpu_wall_ticks; 0: no limit) records where
  // in *timeout (host-mapped) and traps, so a lost signal fails instead of hanging
  WaitTimeout* timeout;
  uint64_t wait_timeout_ticks;
  int32_t debug_skip_signal_op;  // tests only: op of step 0 whose items never signal (-1: none)
  // tensor parallelism (dims.lane_ranks > 1, else null / 0): the exchange, the epochs of the
  // steps before this launch (every rank the same), and the rows of a vocabulary-sliced LM head
  const RankExchange* ranks;
  uint64_t step_base;
  int64_t vocab_slice_rows;     // dims.vocab / dims.lane_ranks
};

}  // namespace kog::gpu::decode
