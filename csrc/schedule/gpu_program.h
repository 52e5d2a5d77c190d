// The program as the GPU persistent kernel runs it: the validated program (program.h) with the
// second phase of every ATTN_DECODE inserted after it and the first phase of SAMPLE before it.
// Plain C++ (built in every backend, tested on the CPU).
#pragma once
#include <cstdint>
#include <vector>

#include "schedule/program.h"

namespace kog::schedule {

// GPU-only opcode: the second phase of Opcode::kAttnDecode, the log-sum-exp merge of the
// context partitions. Program opcodes keep their values.
constexpr int32_t kOpAttnCombine = 100;
// GPU-only opcode: the first phase of Opcode::kSample, per (sequence, chunk of the vocabulary):
// the f32 logits output and the chunk summaries the draw reads (ops/sample_chunks.h).
constexpr int32_t kOpSamplePartial = 101;

// Validates the program (validate_program), moves residual adds into their producers
// (fuse_residual_adds), inserts a combine after every ATTN_DECODE:
//   - the combine depends on its partial phase (it reads the partials the partial phase wrote);
//   - every op that depended on an ATTN_DECODE depends on its combine (which writes ATTN);
//   - every partial phase after the first also depends on the previous combine: both use the
//     one partials scratch (a WAR hazard the Python program does not name);
// and a sample partial before SAMPLE, with SAMPLE's deps (it reads LOGITS); SAMPLE keeps its
// deps and gains the partial (it reads the f32 logits and summaries the partial wrote).
// Deps are renumbered to the expanded indices. Throws kog::Error(kInvalidArgument) naming the
// first bad op of the input program.
std::vector<Op> expand_gpu_program(const std::vector<Op>& ops, const ModelDims& dims);

// The residual add of an RMS_NORM(x, residual) moves into the epilogue of the LINEAR that wrote
// x, when x has no other reader: that LINEAR gets out = residual = the residual buffer
// (residual[b, r] = T(T(x.w + bias) + residual[b, r]): the rounding of the unfused pair) and
// the RMS_NORM reads the residual buffer and adds nothing. Each element is then read-modified-
// written by the one work item that computes it, so the norm itself splits into many items
// (the kernel's rows are no longer written while another item reads them). The LINEAR gains a
// dep on the last op before it that touched the residual buffer. Ops in place; same count.
void fuse_residual_adds(std::vector<Op>& ops);

// Ops of an expanded program that no later op depends on. Every op is one of them or an
// ancestor of one, so a new step that waits on these counters waits for the whole previous step.
std::vector<int32_t> program_sinks(const std::vector<Op>& ops);

}  // namespace kog::schedule
