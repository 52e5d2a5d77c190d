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

// GPU-only opcodes of a mixture-of-experts layer: ROUTER becomes kOpRouterGemv and MOE_EXPERTS
// the three ops after it (moe_route.h: the pairs, their order and the scratch they live in).
// kOpRouterGemv (ROUTER's place): the router GEMV (w0 [router_rows, hidden] over in) into the MoE
// scratch's logits, rounded to the run dtype as the CPU executor rounds them; the last of its
// items to finish routes every row (softmax, top-k, renormalized with norm_topk, the shared slots'
// sigmoid gate) into ROUTE, groups the (row, slot) pairs by expert and gathers each pair's row
// of in into the scratch.
constexpr int32_t kOpRouterGemv = 106;
// kOpMoeGateUp (MOE_EXPERTS' place): item (group g, part): the [gate; up] GEMV of group g's expert
// (w0's matrix e_g) over the gathered rows of its pairs, SILU_MUL fused: act [pairs, expert_intermediate].
// The expert's weights depend on the route, so these GEMVs are not staged ahead (is_gemv: false).
constexpr int32_t kOpMoeGateUp = 107;
// kOpMoeDown: item (group g, part): the down GEMV of group g's expert (w1's matrix e_g) over its
// pairs' act rows: y [pairs, hidden] in the run dtype.
constexpr int32_t kOpMoeDown = 108;
// kOpMoeCombine: item (row b, chunk of kRowChunk): out[b] = the f32 sum over b's pairs, in
// ascending expert order, of the pair's weight times its y row, rounded once: MOE_EXPERTS' output.
constexpr int32_t kOpMoeCombine = 109;

// Whether the GPU kernel runs op o as a GEMV over o.w0 whose weights it stages ahead (LINEAR, its
// fused forms, the router). The experts' GEMVs are GEMVs too, but not staged: see kOpMoeGateUp.
KOG_HOST_DEVICE inline bool is_gemv(const Op& o) {
  return Opcode(o.op) == Opcode::kLinear || o.op == kOpLinearSiluMul || o.op == kOpLinearRopeKv ||
         o.op == kOpLinearSamplePartial || o.op == kOpRouterGemv;
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
// the LINEAR's tails write). A mixture-of-experts layer's ROUTER becomes kOpRouterGemv (same
// deps) and its MOE_EXPERTS kOpMoeGateUp (MOE_EXPERTS' deps), kOpMoeDown (on the gate/up) and
// kOpMoeCombine (on the down; ops that depended on MOE_EXPERTS depend on it): a chain, so waits
// stay transitive. MoE needs run-dtype experts, one rank, and the limits of moe_route.h.
// Laneformer's lanes run as they are (lane LINEARs read their lane's slice of x per row, lane-wide
// norms normalize each lane, the LANE_* ops run as small items) on one rank with run-dtype
// weights; no RMS_NORM folds into a lane LINEAR or out of a lane-wide buffer.
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
