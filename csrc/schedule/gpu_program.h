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
// The expert's weights depend on the route: its items are staged (is_staged_gemv) only by a
// workgroup that has acquired the layer's route, never ahead of it (persistent_kernel.cuh).
constexpr int32_t kOpMoeGateUp = 107;
// kOpMoeDown: item (group g, part): the down GEMV of group g's expert (w1's matrix e_g) over its
// pairs' act rows: y [pairs, hidden] in the run dtype.
constexpr int32_t kOpMoeDown = 108;
// kOpMoeCombine: item (row b, chunk of kRowChunk): out[b] = the f32 sum over b's pairs, in
// ascending expert order, of the pair's weight times its y row, rounded once: MOE_EXPERTS' output.
constexpr int32_t kOpMoeCombine = 109;

// Cross-rank ops (ModelDims::lane_ranks > 1; docs/GPU.md, "Tensor parallelism inside the
// persistent kernel"). Each op that combines every rank's data becomes two ops with one channel
// (Op::comm): a push (Op::comm_push = 1: this rank's part into every rank's inbox of the channel,
// then the channel's flag raised on every rank; writes no buffer) and a finish (waits for every
// rank's flag, then combines in rank order and writes what the op writes), the finish depending
// on the push:
//   LANE_SUM / LANE_MEAN / LANE_MERGE_SUM: push the f32 sum over the rank's lanes of each element
//     (MERGE_SUM: of round(residual_l + in_l)); finish: the ranks' sums added in rank order.
//   ALL_REDUCE (a "lane" head's partial logits): push them as f32; finish: the sum in rank order.
//   ALL_GATHER (a vocabulary-parallel head): push the rank's slice of LOGITS; finish: every slice.
//   The logits' finish also runs SAMPLE's first phase (as kOpLinearSamplePartial's tails do on
//   one rank): its items are the sample chunks, each writing its LOGITS chunk, the chunk's f32
//   logits output and its summary.
//   LANE_GATHER: only a push (its lanes, in the run dtype); the LANE_ADD_PAST that reads its slot
//     is the finish of that channel, broadcast_delay layers later.
// A push's channel reaches every rank by the same index: every rank's program is the same op
// list (only the weights and dims.lane_rank differ).
// Whether o is the logits' finish (of ALL_GATHER / ALL_REDUCE): its items are the sample chunks,
// each followed by SAMPLE's first phase.
KOG_HOST_DEVICE inline bool is_logits_finish(const Op& o) {
  return o.comm >= 0 && !o.comm_push && (Opcode(o.op) == Opcode::kAllGather || Opcode(o.op) == Opcode::kAllReduce);
}

// Bytes of one rank's part of the inbox of push o (its channel) for `batch` rows.
inline int64_t comm_part_bytes(const ModelDims& d, const Op& o, int64_t batch) {
  const int64_t elem = dtype_size(d.dtype);
  switch (Opcode(o.op)) {
    case Opcode::kLaneGather: return batch * d.n_lanes * d.hidden * elem;
    case Opcode::kAllReduce: return batch * d.vocab * 4;
    case Opcode::kAllGather: return batch * (d.vocab / d.lane_ranks) * elem;
    default: return batch * d.hidden * 4;  // LANE_SUM, LANE_MEAN, LANE_MERGE_SUM: f32 partials
  }
}

// Where each channel of an expanded program lives in a rank's inbox, [2 parities][channels]
// [lane_ranks parts]: a step writes parity step % 2 (docs/GPU.md: why two).
struct CommLayout {
  std::vector<int64_t> offset;  // [channels] bytes from a parity's start to the channel's rank-0 part
  std::vector<int64_t> part;    // [channels] bytes of one rank's part (a multiple of 256)
  int64_t parity_bytes = 0;     // one parity: every channel's lane_ranks parts
};
// Throws kog::Error(kInvalidArgument) when the channels are not numbered 0.. in program order.
CommLayout comm_layout(const std::vector<Op>& ops, const ModelDims& dims, int64_t batch);

// Whether the GPU kernel runs op o as a GEMV over o.w0 whose weights it stages ahead (LINEAR, its
// fused forms, the router). The experts' GEMVs are GEMVs too, staged once the route is known
// (is_moe_expert_gemv).
KOG_HOST_DEVICE inline bool is_gemv(const Op& o) {
  return Opcode(o.op) == Opcode::kLinear || o.op == kOpLinearSiluMul || o.op == kOpLinearRopeKv ||
         o.op == kOpLinearSamplePartial || o.op == kOpRouterGemv;
}
// The experts' GEMVs: item (group, part) reads the matrix of the expert its group chose.
KOG_HOST_DEVICE inline bool is_moe_expert_gemv(const Op& o) { return o.op == kOpMoeGateUp || o.op == kOpMoeDown; }
// Ops whose items the kernel may run from weight stages (the staging walk's next_linear table).
KOG_HOST_DEVICE inline bool is_staged_gemv(const Op& o) { return is_gemv(o) || is_moe_expert_gemv(o); }

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
// stay transitive. MoE needs run-dtype experts and the limits of moe_route.h; on tensor-parallel
// ranks, one expert placement for every MoE layer (GpuDecodeExecutor).
// Laneformer's lanes run as they are (lane LINEARs read their lane's slice of x per row, lane-wide
// norms normalize each lane, the LANE_* ops run as small items) with run-dtype weights; no
// RMS_NORM folds into a lane LINEAR or out of a lane-wide buffer. On a tensor-parallel rank
// (lane_ranks > 1) each cross-rank op becomes a push and a finish (above; dependents wait for the
// finish, LANE_GATHER's for its push), and SAMPLE's first phase runs in the logits' finish.
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
