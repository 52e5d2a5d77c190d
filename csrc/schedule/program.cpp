// Validation of the model program. Contract: program.h.
#include "schedule/program.h"

#include <string>

#include "common/errors.h"

namespace kog::schedule {

namespace {

bool valid_buffer(int32_t b) { return b >= 0 && b < int32_t(Buffer::kNumBuffers); }

bool is_moe(Opcode op) { return op == Opcode::kRouter || op == Opcode::kMoeExperts; }

bool is_lane(Opcode op) { return op >= Opcode::kLaneScale && op <= Opcode::kLaneMergeSum; }

bool needs_layer(Opcode op) {
  return op == Opcode::kKvAppend || op == Opcode::kAttnDecode || op == Opcode::kQkNorm || is_moe(op);
}

bool needs_weight(Opcode op) {
  return op == Opcode::kEmbed || op == Opcode::kRmsNorm || op == Opcode::kLinear || op == Opcode::kQkNorm ||
         is_moe(op);
}

// ROUTER writes ROUTE from a hidden-wide buffer; MOE_EXPERTS reads a hidden-wide buffer (and ROUTE)
// and writes another; only ROUTER writes ROUTE, and only MoE ops exist in an MoE model's dims.
void check_moe(const Op& o, size_t i, const ModelDims& d) {
  const auto op = Opcode(o.op);
  const int32_t route = int32_t(Buffer::kRoute);
  KOG_CHECK(op == Opcode::kRouter || o.out != route, "program: op ", i, " (opcode ", o.op,
            ") writes the ROUTE buffer, which only ROUTER writes");
  if (!is_moe(op)) return;
  KOG_CHECK(d.n_experts > 0, "program: op ", i, " is an MoE op (opcode ", o.op, ") but the dims have no experts");
  KOG_CHECK(o.in != route && buffer_width(d, o.in) == d.hidden, "program: op ", i,
            " must read a hidden-wide buffer, reads ", o.in);
  if (op == Opcode::kRouter) {
    KOG_CHECK(o.out == route, "program: op ", i, " (ROUTER) must write ROUTE, writes ", o.out);
  } else {
    KOG_CHECK(o.out != route && o.out != o.in && buffer_width(d, o.out) == d.hidden, "program: op ", i,
              " (MOE_EXPERTS) must write a hidden-wide buffer other than its input, writes ", o.out);
    KOG_CHECK(o.w1 != nullptr, "program: op ", i, " (MOE_EXPERTS) needs gate_up and down weights");
  }
}

// A quantized weight: a type this build has kernels for, on EMBED, LINEAR or MOE_EXPERTS (w1 on
// MOE_EXPERTS only), rows of whole blocks (k = the input width; EMBED's rows and an expert's
// gate_up rows are hidden wide, its down rows expert_intermediate wide), in an f32 run.
// rows: of one matrix (EMBED's vocab, LINEAR's output width, one expert's rows), whole groups for a
// packed (row-interleaved) type.
void check_quant_type(int32_t type, const char* which, int64_t k, int64_t rows, size_t i, const ModelDims& d) {
  const QuantTypeInfo info = quant_type_info(QuantType(type));
  KOG_CHECK(info.name != nullptr, "program: op ", i, " has ", which, " type ", type,
            " (supported: the run dtype, FP8=-2, 4-bit groups=-3, Q4_K for the GPU=-4, ", quant_type_list(), ")");
  KOG_CHECK(d.dtype == DType::kF32, "program: op ", i, " reads a ", info.name, " weight but the run dtype is ",
            dtype_name(d.dtype), " (quantized weights run with f32 activations)");
  KOG_CHECK(k % info.elems == 0, "program: op ", i, " has rows of ", k, " elements, not whole ", info.name,
            " blocks of ", info.elems);
  KOG_CHECK(!is_packed(QuantType(type)) || rows % kPackRows == 0, "program: op ", i, " has a ", info.name,
            " matrix of ", rows, " rows, not whole groups of ", kPackRows);
}

// Lane ops read lane-wide buffers ([batch, n_lanes, hidden]); the in-place ones write what they
// read, LANE_GATHER / LANE_ADD_PAST name a LANE_HIST slot, the merges write a hidden-wide buffer;
// only LANE_GATHER writes LANE_HIST. A lane LINEAR cuts its input and every output segment
// into n_lanes equal parts.
void check_lanes(const Op& o, size_t i, const ModelDims& d) {
  const auto op = Opcode(o.op);
  const int32_t hist = int32_t(Buffer::kLaneHist);
  KOG_CHECK(op == Opcode::kLaneGather || o.out != hist, "program: op ", i, " (opcode ", o.op,
            ") writes LANE_HIST, which only LANE_GATHER writes");
  const bool has_slot = op == Opcode::kLaneGather || op == Opcode::kLaneAddPast;
  KOG_CHECK(has_slot ? o.slot >= 0 && o.slot < d.lane_hist_slots : o.slot == -1, "program: op ", i,
            " has LANE_HIST slot ", o.slot, has_slot ? " (the dims have " : " but is not a lane-history op (",
            d.lane_hist_slots, " slots)");
  KOG_CHECK(o.lanes == 1 || (op == Opcode::kLinear && o.lanes == d.n_lanes), "program: op ", i, " has lanes=",
            o.lanes, " (1, or n_lanes=", d.n_lanes, " on a LINEAR)");
  if (op == Opcode::kLinear && o.lanes > 1) {
    int64_t seg[3];
    const int n = lane_segments(d, o.out, seg);
    bool even = buffer_width(d, o.in) % o.lanes == 0;
    for (int s = 0; s < n; ++s) even = even && seg[s] % o.lanes == 0;
    KOG_CHECK(even, "program: op ", i, " (lane LINEAR) reads buffer ", o.in, " and writes ", o.out,
              ", which do not split into ", o.lanes, " lanes");
    KOG_CHECK(o.w_type == kWeightRunDtype, "program: op ", i, " is a lane LINEAR over a quantized weight");
    KOG_CHECK(o.out != int32_t(Buffer::kLogits) || o.vocab_slice == (d.lane_ranks > 1 ? 1 : 0), "program: op ", i,
              " (a lane LINEAR into LOGITS) must set vocab_slice exactly on a tensor-parallel rank");
  }
  if (!is_lane(op)) return;
  const int64_t lane_w = d.n_lanes * d.hidden;
  KOG_CHECK(o.in != hist && buffer_width(d, o.in) == lane_w, "program: op ", i, " (opcode ", o.op,
            ") must read a lane-wide buffer, reads ", o.in);
  if (op == Opcode::kLaneGather) {
    KOG_CHECK(o.out == hist, "program: op ", i, " (LANE_GATHER) must write LANE_HIST, writes ", o.out);
  } else if (op == Opcode::kLaneMean || op == Opcode::kLaneMergeSum) {
    KOG_CHECK(buffer_width(d, o.out) == d.hidden && o.out != int32_t(Buffer::kTokens), "program: op ", i,
              " (opcode ", o.op, ") must write a hidden-wide buffer, writes ", o.out);
    KOG_CHECK((op == Opcode::kLaneMergeSum) == (o.residual >= 0) &&
                  (o.residual < 0 || buffer_width(d, o.residual) == lane_w),
              "program: op ", i, ": LANE_MERGE_SUM (only) adds a lane-wide residual");
  } else {
    KOG_CHECK(o.out == o.in, "program: op ", i, " (opcode ", o.op, ") works in place: writes ", o.out,
              ", reads ", o.in);
  }
}

void check_weight_type(const Op& o, size_t i, const ModelDims& d) {
  const auto op = Opcode(o.op);
  KOG_CHECK(o.w1_type == kWeightRunDtype || op == Opcode::kMoeExperts, "program: op ", i, " (opcode ", o.op,
            ") has w1 type ", o.w1_type, ": only MOE_EXPERTS' down weight may be quantized");
  if (o.w1_type != kWeightRunDtype) check_quant_type(o.w1_type, "w1", d.expert_intermediate, d.hidden, i, d);
  KOG_CHECK((o.w_scale != nullptr) == is_gpu_weight_format(o.w_type), "program: op ", i,
            o.w_scale != nullptr ? " has weight scales but its weight is not in a GPU format (FP8, 4-bit)"
                                 : " reads an FP8 or 4-bit weight without its scales (w_scale)");
  if (o.w_type == kWeightRunDtype) return;
  if (is_gpu_weight_format(o.w_type)) {
    // One 16-byte GEMV vector: 16 FP8 elements, or one 32-element 4-bit group; Q4_K headers
    // cover super-blocks of 256.
    const char* name = o.w_type == kWeightFp8 ? "FP8" : o.w_type == kWeightQ4K ? "Q4_K" : "4-bit";
    const int64_t unit = o.w_type == kWeightFp8 ? 16 : o.w_type == kWeightQ4K ? 256 : 32;
    KOG_CHECK(op == Opcode::kLinear && o.lanes == 1, "program: op ", i, " (opcode ", o.op, ") cannot read an ", name,
              " weight: only a (non-lane) LINEAR takes one");
    KOG_CHECK(buffer_width(d, o.in) % unit == 0, "program: op ", i, " has ", name, " rows of ", buffer_width(d, o.in),
              " elements, not a multiple of ", unit);
    KOG_CHECK(o.w_type == kWeightFp8 || d.dtype == DType::kBF16, "program: op ", i, " reads a ", name,
              " weight but the run dtype is ", dtype_name(d.dtype),
              " (4-bit GPU weights run with bfloat16 activations)");
    return;
  }
  KOG_CHECK(op == Opcode::kEmbed || op == Opcode::kLinear || op == Opcode::kMoeExperts, "program: op ", i,
            " (opcode ", o.op, ") cannot read a quantized weight (type ", o.w_type,
            "): only EMBED, LINEAR and MOE_EXPERTS take quantized weights");
  const int64_t k = op == Opcode::kEmbed || op == Opcode::kMoeExperts ? d.hidden : buffer_width(d, o.in);
  const int64_t rows = op == Opcode::kEmbed        ? d.vocab
                       : op == Opcode::kMoeExperts ? 2 * d.expert_intermediate
                                                   : buffer_width(d, o.out);
  check_quant_type(o.w_type, "weight", k, rows, i, d);
}

void check_op(const Op& o, size_t i, const ModelDims& d) {
  KOG_CHECK(o.op >= 0 && o.op < int32_t(Opcode::kNumOpcodes), "program: op ", i, " has opcode ", o.op);
  const auto op = Opcode(o.op);
  KOG_CHECK(o.layer >= -1 && o.layer < d.n_layers, "program: op ", i, " names layer ", o.layer, " of ",
            d.n_layers);
  KOG_CHECK(!needs_layer(op) || o.layer >= 0, "program: op ", i, " needs a layer");
  KOG_CHECK(valid_buffer(o.in), "program: op ", i, " reads buffer ", o.in);
  KOG_CHECK(o.out == -1 || valid_buffer(o.out), "program: op ", i, " writes buffer ", o.out);
  KOG_CHECK(o.residual == -1 || valid_buffer(o.residual), "program: op ", i, " residual ", o.residual);
  KOG_CHECK(o.residual == -1 || op == Opcode::kRmsNorm || op == Opcode::kLaneMergeSum, "program: op ", i,
            " has a residual but is not RMS_NORM or LANE_MERGE_SUM");
  KOG_CHECK(op == Opcode::kKvAppend || o.out >= 0, "program: op ", i, " writes no buffer");
  KOG_CHECK(!needs_weight(op) || o.w0 != nullptr, "program: op ", i, " has no weight");
  KOG_CHECK(op != Opcode::kQkNorm || o.w1 != nullptr, "program: op ", i, " needs q and k norm weights");
  KOG_CHECK(op != Opcode::kLinear || o.out != int32_t(Buffer::kTokens), "program: op ", i,
            " writes the token buffer");
  check_weight_type(o, i, d);
  check_moe(o, i, d);
  check_lanes(o, i, d);
  KOG_CHECK(o.expert_ranks == nullptr || op == Opcode::kMoeExperts, "program: op ", i,
            " has an expert placement but is not MOE_EXPERTS");
  if (o.expert_ranks != nullptr)
    for (int64_t e = 0; e < d.n_experts + d.shared_slots; ++e)
      KOG_CHECK(o.expert_ranks[e] >= 0 && o.expert_ranks[e] < d.lane_ranks, "program: op ", i, " places expert ", e,
                " on rank ", o.expert_ranks[e], " of ", d.lane_ranks);
  KOG_CHECK(o.vocab_slice == 0 || (op == Opcode::kLinear && o.out == int32_t(Buffer::kLogits) && d.lane_ranks > 1 &&
                                   o.vocab_slice == 1 && d.vocab % d.lane_ranks == 0),
            "program: op ", i, " has vocab_slice ", o.vocab_slice, " (1 only on a LINEAR into LOGITS of a ",
            "tensor-parallel rank whose ranks divide vocab ", d.vocab, ")");
  KOG_CHECK((op != Opcode::kAllReduce && op != Opcode::kAllGather) ||
                (d.lane_ranks > 1 && o.in == int32_t(Buffer::kLogits) && o.out == o.in),
            "program: op ", i, " is a collective (", op == Opcode::kAllReduce ? "ALL_REDUCE" : "ALL_GATHER",
            "): only a tensor-parallel rank's program (lane_ranks > 1) has them, in place on LOGITS");
  KOG_CHECK(o.window == 0 || (op == Opcode::kAttnDecode && o.window > 0), "program: op ", i, " has window ",
            o.window, " (a positive window on ATTN_DECODE only)");
  KOG_CHECK(o.n_deps >= 0 && o.n_deps <= kMaxDeps, "program: op ", i, " has ", o.n_deps, " deps (at most ",
            kMaxDeps, ")");
  for (int k = 0; k < o.n_deps; ++k) {
    KOG_CHECK(o.deps[k] >= 0 && size_t(o.deps[k]) < i, "program: op ", i, " depends on op ", o.deps[k],
              ", which is not an earlier op");
    KOG_CHECK(k == 0 || o.deps[k] > o.deps[k - 1], "program: op ", i, " lists its deps out of order");
  }
}

}  // namespace

void validate_dims(const ModelDims& d) {
  KOG_CHECK(is_float_dtype(d.dtype), "model dims: run dtype must be a float type, got ", dtype_name(d.dtype));
  KOG_CHECK(d.n_layers > 0 && d.hidden > 0 && d.n_q_heads > 0 && d.n_kv_heads > 0 && d.head_dim > 0 &&
                d.intermediate > 0 && d.vocab > 0,
            "model dims: every size must be positive");
  KOG_CHECK(d.n_q_heads % d.n_kv_heads == 0, "model dims: ", d.n_kv_heads, " kv heads do not divide ",
            d.n_q_heads, " query heads");
  KOG_CHECK(d.rotary_dim > 0 && d.rotary_dim % 2 == 0 && d.rotary_dim <= d.head_dim, "model dims: rotary_dim ",
            d.rotary_dim, " must be even and in (0, head_dim ", d.head_dim, "]");
  KOG_CHECK(d.rms_eps > 0.f && d.attn_scale > 0.f, "model dims: rms_eps and attn_scale must be positive");
  KOG_CHECK(d.n_experts >= 0 && d.top_k >= 0 && d.expert_intermediate >= 0 && d.shared_slots >= 0,
            "model dims: negative MoE sizes");
  KOG_CHECK(d.n_experts > 0 || (d.top_k == 0 && d.expert_intermediate == 0 && d.shared_slots == 0),
            "model dims: top_k, expert_intermediate and shared_slots need n_experts > 0");
  KOG_CHECK(d.n_experts == 0 || (d.top_k >= 1 && d.top_k <= d.n_experts && d.expert_intermediate > 0),
            "model dims: top_k ", d.top_k, " must be in [1, n_experts ", d.n_experts,
            "] and expert_intermediate positive");
  KOG_CHECK(d.n_lanes >= 1 && d.lane_hist_slots >= 0, "model dims: n_lanes ", d.n_lanes, " must be >= 1 and ",
            "lane_hist_slots ", d.lane_hist_slots, " >= 0");
  KOG_CHECK(d.n_q_heads % d.n_lanes == 0 && d.n_kv_heads % d.n_lanes == 0 && d.intermediate % d.n_lanes == 0,
            "model dims: ", d.n_lanes, " lanes must divide the query heads (", d.n_q_heads, "), the KV heads (",
            d.n_kv_heads, ") and intermediate (", d.intermediate, ")");
  KOG_CHECK(d.n_lanes == 1 || d.n_experts == 0, "model dims: experts need one lane per rank (n_lanes ", d.n_lanes,
            "): a mixture-of-experts block reads a hidden-wide stream");
  KOG_CHECK(d.lane_ranks >= 1 && d.lane_rank >= 0 && d.lane_rank < d.lane_ranks, "model dims: lane rank ",
            d.lane_rank, " of ", d.lane_ranks);
}

void validate_program(const std::vector<Op>& ops, const ModelDims& d) {
  KOG_CHECK(!ops.empty(), "program: no ops");
  for (size_t i = 0; i < ops.size(); ++i) check_op(ops[i], i, d);
  KOG_CHECK(Opcode(ops.back().op) == Opcode::kSample, "program: the last op must be SAMPLE");
}

std::string quant_type_list() {
  std::string out;
  auto add = [&out](QuantType t) {
    out += (out.empty() ? "" : ", ") + std::string(quant_type_info(t).name) + "=" + std::to_string(int(t));
  };
  for (QuantType t : kQuantTypes) add(t);
  for (QuantType t : kPackedQuantTypes) add(t);
  return out;
}

}  // namespace kog::schedule
