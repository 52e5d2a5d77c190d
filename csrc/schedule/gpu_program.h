// The program as the GPU persistent kernel runs it: the validated program (program.h) with ops
// fused into their GEMVs and the first phase of SAMPLE in the LM head's item tails.
// Plain C++ (built in every backend, tested on the CPU).
#pragma once
#include <cstdint>
#include <vector>

#include "common/host_device.h"
#include "schedule/program.h"

namespace kog::schedule {

// GPU-only opcodes (program opcodes keep their values). Retired: 100, the attention combine (now
// the tail of ATTN_DECODE's last item per (sequence, KV head)), and 101, the sample partial op
// (now the tail of kOpLinearSamplePartial).
// GPU-only opcode: a LINEAR into GATE_UP fused with the SILU_MUL that reads it: out (ACT)[b, g] =
// T(silu(T(x . w_g)) * T(x . w_{inter + g})), the rounding of the unfused pair; w0 the gate/up
// weight [2 * intermediate, hidden].
constexpr int32_t kOpLinearSiluMul = 102;
// GPU-only opcode: the LINEAR into QKV fused with the ROPE and KV_APPEND after it (no QK_NORM,
// rotary_dim == head_dim): each warp computes one RoPE pair of rows, rotates q/k pairs at the
// row's position, writes QKV and, for k and v, the layer's cache at the row's slot. layer: the
// KV_APPEND's.
constexpr int32_t kOpLinearRopeKv = 104;
// GPU-only opcode: the LM head (the LINEAR into LOGITS that SAMPLE reads) with SAMPLE's first
// phase as the tail of its items: the last item to finish of each chunk of kSampleChunk rows
// writes, for every sequence, the chunk's f32 logits output and its summary (ops/sample_chunks.h)
// that SAMPLE draws from. A plain LINEAR otherwise (rows, epilogue, staging).
constexpr int32_t kOpLinearSamplePartial = 105;

// Whether the GPU kernel runs op o as a GEMV over o.w0 (LINEAR and the fused LINEAR + SILU_MUL).
KOG_HOST_DEVICE inline bool is_gemv(const Op& o) {
  return Opcode(o.op) == Opcode::kLinear || o.op == kOpLinearSiluMul || o.op == kOpLinearRopeKv ||
         o.op == kOpLinearSamplePartial;
}

// Validates the program (validate_program), moves residual adds into their producers
// (fuse_residual_adds), folds each RMS_NORM left without an add into the prologue of the LINEAR
// that reads its output (the LINEAR reads the norm's input, w2 = the norm's weight, and takes
// the norm's deps; ops that depended on the norm depend on the LINEAR), fuses each SILU_MUL into the LINEAR that feeds it (kOpLinearSiluMul:
// the fused op keeps the LINEAR's place, takes the SILU_MUL's output and deps, and ops that
// depended on the SILU_MUL depend on it), makes every ATTN_DECODE after the first depend on the
// previous one (both use the one partials scratch: a WAR hazard the Python program does not
// name; the kernel's ATTN_DECODE writes its partials there and its last item per (sequence,
// KV head) merges them into ATTN), and turns the LINEAR that writes SAMPLE's input (LOGITS) into
// kOpLinearSamplePartial (SAMPLE already depends on it; it reads the f32 logits and summaries
// the LINEAR's tails write).
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
