// The decode schedule as the GPU persistent kernel runs it: a flat list of device ops, each
// split into work items spread over the workgroups, each waiting on the one before it through a
// completion counter. Plain C++ (built in every backend, tested on the CPU).
#pragma once
#include <cstdint>
#include <vector>

#include "schedule/opcodes.h"

namespace kog::schedule {

// GPU-only opcode: the second phase of Opcode::kAttnDecode, the log-sum-exp merge of the
// context partitions. Schedule opcodes keep their values.
constexpr int32_t kOpAttnCombine = 100;

// One operation of the device program (same operands as the CPU executor's Instruction).
struct GpuOp {
  int32_t op;          // Opcode value or kOpAttnCombine
  int32_t layer;       // -1 for model-level ops
  int32_t in;          // Buffer read, -1 if none
  int32_t residual;    // RMS_NORM only: the residual stream it adds `in` to, or -1
  int32_t out;         // Buffer written, -1 if none
  int32_t pad_ = 0;
  const void* w0;      // EMBED: [vocab, hidden]; LINEAR: [n, k]; norms: [width]; QK_NORM: q_norm
  const void* w1;      // LINEAR: bias [n] or null; QK_NORM: k_norm [head_dim]
};

// Checks the ops (opcodes, buffers, weights present) and inserts the combine phase after every
// ATTN_DECODE. Throws kog::Error(kInvalidArgument) naming the first bad op.
std::vector<GpuOp> expand_gpu_program(const std::vector<GpuOp>& schedule_ops, int32_t n_layers);

}  // namespace kog::schedule
