// The model program: ONE description of a decode step that both the CPU executor
// (csrc/engine/decode_executor.h) and the GPU persistent kernel (csrc/gpu/decode/) run, built on
// the host by kog.program and lowered to raw operands by kog/models/decode.py. Plain C++ (every
// build; the parts the kernel reads are host+device inline functions).
//
//   ModelDims dims{...};               // once per model config (kog.models.decode.model_dims)
//   validate_program(ops, dims);       // throws kog::Error(kInvalidArgument) naming the bad op
//   buffer_width(dims, Buffer::kQkv);  // the one definition of every activation width
//
// Invariant of a valid program: op i lists in deps the indices (< i) of the ops that must
// complete before it starts; program order is a topological order of that graph, and any
// executor that starts an op only after its deps completed computes what the sequential order
// computes (kog/program/schedule.py derives deps from reads and writes: RAW, WAW and WAR).
#pragma once
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/host_device.h"
#include "ops/quant.h"
#include "schedule/opcodes.h"

namespace kog::schedule {

// The shape of one model, as every executor needs it. Built once from kog.config.ModelConfig.
struct ModelDims {
  int64_t n_layers;
  int64_t hidden;
  int64_t n_q_heads;
  int64_t n_kv_heads;     // divides n_q_heads
  int64_t head_dim;
  int64_t intermediate;
  int64_t vocab;
  int64_t rotary_dim;     // rotated dims of each head, even, <= head_dim (2 x len(inv_freq))
  float rms_eps;
  float attn_scale;       // softmax scale, usually head_dim^-0.5
  bool rope_neox;         // rotate_half pairs (i, i + rotary_dim / 2); false: interleaved pairs
  DType dtype;            // run dtype of weights, activations and the KV cache (f32/f16/bf16)
  // Mixture of experts (all 0 / false in a dense model). Defaults last, so aggregate
  // initializers of dense dims keep their meaning.
  int64_t n_experts = 0;            // routed experts of an MoE layer
  int64_t top_k = 0;                // experts each token runs, 1..n_experts
  int64_t expert_intermediate = 0;  // one expert's intermediate width
  bool norm_topk = false;           // renormalize the top_k routing weights to sum 1
  // Always-on experts n_experts .. n_experts + shared_slots - 1 after the routed ones: a shared
  // expert cut into expert_intermediate-wide slices (qwen2_moe), each weighted by
  // sigmoid(in @ router row n_experts), the router's extra row.
  int64_t shared_slots = 0;
  // Laneformer lanes (1 / false / 0 in every other model): HIDDEN, RESIDUAL and NORMED hold one
  // hidden-wide stream per lane ([batch, n_lanes, hidden]); RMS_NORM normalizes each lane, with
  // a weight per lane ([n_lanes, hidden]) when lane_norm_weights, else one shared [hidden]
  // weight; LANE_HIST holds lane_hist_slots lane-wide rows per batch row.
  int64_t n_lanes = 1;
  bool lane_norm_weights = false;
  int64_t lane_hist_slots = 0;
  // Tensor parallelism over lanes (kog.parallel): this program is rank lane_rank of lane_ranks,
  // holding lanes lane_rank n_lanes .. of n_lanes lane_ranks; its lane ops and collectives reduce
  // over every rank through the executor's transport. LANE_HIST holds every rank's lanes.
  int64_t lane_ranks = 1;
  int64_t lane_rank = 0;
};

// The paged KV cache an executor writes and attends over (host or device memory).
struct KVCacheDesc {
  void* base;             // [n_layers, num_blocks, 2, n_kv_heads, block_size, head_dim] dtype, contiguous
  int64_t num_blocks;
  int64_t block_size;
  DType dtype;            // the cache's elements: the run dtype, or (CPU executor) a narrower float
                          //   than f32 activations (a bf16 / f16 KV cache)
};

// Op::w_type of a weight stored in the run dtype (every weight of a float model; norms and
// biases always). Any other value is a ggml QuantType id (csrc/ops/quant.h).
constexpr int32_t kWeightRunDtype = -1;
// Op::w_type of a LINEAR weight stored as FP8 e4m3, one byte per element, with one f32 scale per
// weight row in Op::w_scale (w[r, c] = w_scale[r] * e4m3(w0[r, c])); any float run dtype in a
// program, bf16 in the GPU kernel (its one quantized-weight instantiation). The GPU decode
// kernel's format only: the bits are the target's e4m3 (OCP e4m3fn on NVIDIA,
// e4m3fnuz on AMD, whose values are half the OCP ones for the same bits; gpu/vendor/*.h), so the
// loader encodes for the device (kog.fp8). Not a ggml id (those are >= 0). The CPU executor
// refuses it: an FP8 model is dequantized to the run dtype at load there.
constexpr int32_t kWeightFp8 = -2;
// Op::w_type of a LINEAR weight stored as 4-bit codes q in [0, 15] with an affine (scale, min) per
// group of 32 consecutive elements of a row: w[r, c] = scale[r, g] * q[r, c] + min[r, g], g = c / 32.
// w0: uint8 [rows, k / 2], each 16 bytes one group, byte j holding elements j (low nibble) and
// j + 16 (high): the Q4_0 / Q4_1 block order. Op::w_scale: [rows, k / 32] pairs (f16 scale, f16
// min), 4 bytes a group. Q4_0 (min = -8 scale), Q4_1 and GPTQ / AWQ (min = -scale * zero, via
// Q4_1) become this at load for the GPU (kog.int4). The GPU decode kernel's format only; bf16
// runs. Not a ggml id.
constexpr int32_t kWeightQ4Groups = -3;
// Op::w_type of a LINEAR weight from GGUF Q4_K: w0 the same nibble layout as kWeightQ4Groups
// (super-block sub-blocks repacked to 16-byte groups of 32), Op::w_scale [rows, k / 256] the
// super-blocks' 16-byte headers as the file holds them (f16 d, f16 dmin, 12 bytes of 6-bit scales
// and mins): group j of a super-block is scale d * sc_j, min -dmin * m_j, exactly the format's
// values. The GPU decode kernel's format only; bf16 runs.
constexpr int32_t kWeightQ4K = -4;

// Whether w_type is one of the GPU kernel's quantized LINEAR formats (FP8, the 4-bit ones):
// stored in the GPU layout with their scales in Op::w_scale; the CPU executor refuses them.
KOG_HOST_DEVICE constexpr bool is_gpu_weight_format(int32_t w_type) {
  return w_type == kWeightFp8 || w_type == kWeightQ4Groups || w_type == kWeightQ4K;
}

// Most ops one op may wait for. schedule.py's Llama-family ops have at most 4.
constexpr int kMaxDeps = 8;

// One operation of the program with its operands resolved. Buffers not used are -1.
struct Op {
  int32_t op;             // Opcode value (or, in the GPU's expanded program, a GPU-only opcode: gpu_program.h)
  int32_t layer;          // -1 for model-level ops
  int32_t in;             // Buffer read (RMS_NORM: x; LINEAR: x; ...)
  int32_t residual;       // RMS_NORM only: the residual stream it adds x to and normalizes, or -1
  int32_t out;            // Buffer written, -1 if none (KV_APPEND writes the layer's cache)
  int32_t n_deps;         // 0..kMaxDeps
  const void* w0;         // EMBED: [vocab, hidden]; LINEAR: [n, k]; norms: [width]; QK_NORM: q_norm [head_dim]
                          // (EMBED/LINEAR with a quant w_type: uint8 [rows, k / elems * bytes] GGUF blocks)
                          // ROUTER: [n_experts (+ 1 with shared_slots), hidden]; MOE_EXPERTS: gate_up
                          // [n_experts + shared_slots, 2 expert_intermediate, hidden]
  const void* w1;         // LINEAR: bias [n] (run dtype) or null; QK_NORM: k_norm [head_dim]
                          // MOE_EXPERTS: down [n_experts + shared_slots, hidden, expert_intermediate]
  int32_t deps[kMaxDeps]; // [n_deps] indices of earlier ops that must complete first, ascending
  // GPU expanded program only (null in a program): a GEMV's RMSNorm prologue weight [width(in)]:
  // x = rmsnorm(in) * w2 (expand_gpu_program).
  const void* w2 = nullptr;
  // Storage of w0: kWeightRunDtype, a GPU format (is_gpu_weight_format: LINEAR only, with
  // w_scale), or a QuantType (EMBED,
  // LINEAR and MOE_EXPERTS only, run dtype
  // f32: the quant GEMV writes f32; MOE_EXPERTS' stacked blocks are [(n_experts + shared_slots)
  // 2 expert_intermediate, hidden / elems * bytes]). w2, w_type and w1_type come last, with
  // defaults, so aggregate initializers that predate them keep meaning a float weight and no prologue.
  int32_t w_type = kWeightRunDtype;
  // Storage of w1: MOE_EXPERTS' down may be a QuantType ([(n_experts + shared_slots) hidden,
  // expert_intermediate / elems * bytes] blocks); every other op's w1 is in the run dtype.
  int32_t w1_type = kWeightRunDtype;
  // LINEAR only: 1, or n_lanes for a lane projection: each segment of the output row
  // (lane_segments) is cut into `lanes` equal ranges, and range l reads columns
  // [l k, (l + 1) k) of in, k = width(in) / lanes (the weight is [n, k], rows lane-major).
  int32_t lanes = 1;
  // LANE_GATHER: the LANE_HIST slot written; LANE_ADD_PAST: the slot read. -1 otherwise.
  int32_t slot = -1;
  // ATTN_DECODE: 0, or a sliding window (PagedAttentionParams::window). 0 on every other op.
  int32_t window = 0;
  // LINEAR into LOGITS on a tensor-parallel rank (lane_ranks > 1): 1 when it computes only the
  // rank's vocabulary slice, columns [lane_logits_offset, + vocab / lane_ranks) (a
  // vocabulary-parallel head; its ALL_GATHER fills the others), its weight that slice's rows.
  int32_t vocab_slice = 0;
  // MOE_EXPERTS: null, or [n_experts + shared_slots] the tensor-parallel rank each expert runs on
  // (expert parallelism): a rank computes only the pairs routed to its experts, and the LANE_SUM
  // after the block adds the ranks' partial outputs; w0 / w1 then stack only this rank's experts
  // ([local experts, ...], in ascending expert order). On one rank every expert must be its own.
  const int32_t* expert_ranks = nullptr;
  // A GPU weight format's scales (else null): kWeightFp8 [rows] f32 per row; kWeightQ4Groups
  // [rows, k / 32] (f16, f16) per group; kWeightQ4K [rows, k / 256] 16-byte super-block headers.
  const void* w_scale = nullptr;
  // GPU expanded program of a tensor-parallel rank only (gpu_program.h, "cross-rank ops"): the
  // channel, 0.., of a cross-rank op's half, -1 on every other op; comm_push 1: the push half
  // (this rank's part stored into every rank's inbox of the channel, then its flag raised on every
  // rank), 0: the finish half (waits for every rank's flag of the channel, then combines).
  int32_t comm = -1;
  int32_t comm_push = 0;
};

// Elements per batch row of buffer b (TOKENS: one int32 id; LOGITS: vocab in the run dtype).
KOG_HOST_DEVICE inline int64_t buffer_width(const ModelDims& d, int32_t b) {
  switch (Buffer(b)) {
    case Buffer::kTokens: return 1;
    case Buffer::kHidden:
    case Buffer::kResidual:
    case Buffer::kNormed: return d.n_lanes * d.hidden;
    case Buffer::kMerged: return d.hidden;
    case Buffer::kLaneHist: return d.lane_hist_slots * d.n_lanes * d.lane_ranks * d.hidden;
    case Buffer::kQkv: return (d.n_q_heads + 2 * d.n_kv_heads) * d.head_dim;
    case Buffer::kAttn: return d.n_q_heads * d.head_dim;
    case Buffer::kGateUp: return 2 * d.intermediate;
    case Buffer::kAct: return d.intermediate;
    case Buffer::kLogits: return d.vocab;
    case Buffer::kRoute: return 2 * (d.top_k + d.shared_slots);
    default: return 0;
  }
}

// The output segments a lane LINEAR cuts into lanes: QKV is [q | k | v] (each lane owns
// n_q_heads / n_lanes query heads and n_kv_heads / n_lanes KV heads), GATE_UP [gate | up], any
// other buffer one segment. Returns the count, widths in seg[0..count).
KOG_HOST_DEVICE inline int lane_segments(const ModelDims& d, int32_t out, int64_t seg[3]) {
  if (out == int32_t(Buffer::kQkv)) {
    seg[0] = d.n_q_heads * d.head_dim, seg[1] = seg[2] = d.n_kv_heads * d.head_dim;
    return 3;
  }
  if (out == int32_t(Buffer::kGateUp)) {
    seg[0] = seg[1] = d.intermediate;
    return 2;
  }
  // LOGITS: a rank's vocabulary slice (Op::vocab_slice; the whole vocabulary on one rank).
  seg[0] = out == int32_t(Buffer::kLogits) ? d.vocab / d.lane_ranks : buffer_width(d, out);
  return 1;
}

// The lane whose slice of the input each output row of a lane LINEAR reads (op.lanes > 1): the
// row's segment (lane_segments) cut into op.lanes equal ranges; range l reads columns
// [l k, (l + 1) k), k = width(in) / lanes. The GPU kernel's lane GEMV rows (gpu/decode/linear_item.cuh);
// the CPU executor's lane matrices are the same ranges. 32-bit and constant-indexed, so that it
// stays in five registers.
struct LaneRows {
  int32_t seg_end[2] = {INT32_MAX, INT32_MAX};  // rows up to the end of segment s (past the last: INT32_MAX)
  int32_t lane_rows[3] = {1, 1, 1};             // rows of one lane in segment s

  KOG_HOST_DEVICE static LaneRows of(const ModelDims& d, const Op& op) {
    LaneRows m;
    int64_t seg[3];
    const int n = lane_segments(d, op.out, seg);
    for (int s = 0; s < 3; ++s) {  // unrolled: constant indices
      if (s < n) m.lane_rows[s] = int32_t(seg[s] / op.lanes);
      if (s < 2 && s + 1 < n) m.seg_end[s] = int32_t((s > 0 ? m.seg_end[s - 1] : 0) + seg[s]);
    }
    return m;
  }
  KOG_HOST_DEVICE int64_t lane_of(int64_t row) const {
    int32_t r = int32_t(row), start = 0, rows = lane_rows[0];
    if (r >= seg_end[0]) start = seg_end[0], rows = lane_rows[1];
    if (r >= seg_end[1]) start = seg_end[1], rows = lane_rows[2];
    return (r - start) / rows;
  }
};

// First LOGITS column a rank's lane LINEAR into LOGITS writes (its vocabulary slice; 0 on one rank).
KOG_HOST_DEVICE inline int64_t lane_logits_offset(const ModelDims& d) { return d.lane_rank * (d.vocab / d.lane_ranks); }

// Bytes per element of buffer b: TOKENS holds int32 ids and ROUTE 4-byte words (int32 ids, f32
// weights), every other buffer the run dtype.
inline int64_t buffer_elem_size(const ModelDims& d, int32_t b) {
  return b == int32_t(Buffer::kTokens) || b == int32_t(Buffer::kRoute) ? 4 : dtype_size(d.dtype);
}

// Checks the dims (positive sizes, heads that group, a float run dtype, rotary_dim).
// Throws kog::Error(kInvalidArgument) naming the bad field.
void validate_dims(const ModelDims& d);

// Checks every op (opcode, layer, buffers, weights, deps in [0, i) and ascending) and that the
// last op is SAMPLE. Throws kog::Error(kInvalidArgument) naming the first bad op.
void validate_program(const std::vector<Op>& ops, const ModelDims& d);

// "Q4_0=2, Q4_1=3, ..., Q6_K_R8=270": the block types (file forms, then packed) this build has
// kernels for, as error messages list them.
std::string quant_type_list();

}  // namespace kog::schedule
