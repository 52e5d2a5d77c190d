// Validation of the model program. Contract: program.h.
#include "schedule/program.h"

#include "common/errors.h"

namespace kog::schedule {

namespace {

bool valid_buffer(int32_t b) { return b >= 0 && b < int32_t(Buffer::kNumBuffers); }

bool is_moe(Opcode op) { return op == Opcode::kRouter || op == Opcode::kMoeExperts; }

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

// A quantized weight: a type this build has kernels for, on EMBED or LINEAR, rows of whole
// blocks (k = the input width; EMBED's rows are hidden wide), in an f32 run.
void check_weight_type(const Op& o, size_t i, const ModelDims& d) {
  KOG_CHECK((o.w_scale != nullptr) == (o.w_type == kWeightFp8), "program: op ", i,
            o.w_scale != nullptr ? " has a weight scale but its weight is not FP8"
                                 : " reads an FP8 weight without its row scales (w_scale)");
  if (o.w_type == kWeightRunDtype) return;
  if (o.w_type == kWeightFp8) {  // one 16-byte GEMV vector is 16 elements
    KOG_CHECK(Opcode(o.op) == Opcode::kLinear, "program: op ", i, " (opcode ", o.op,
              ") cannot read an FP8 weight: only LINEAR takes one");
    KOG_CHECK(buffer_width(d, o.in) % 16 == 0, "program: op ", i, " has FP8 rows of ", buffer_width(d, o.in),
              " elements, not a multiple of 16");
    return;
  }
  const QuantTypeInfo info = quant_type_info(QuantType(o.w_type));
  KOG_CHECK(info.name != nullptr, "program: op ", i, " has weight type ", o.w_type,
            " (supported: the run dtype, FP8=-2 or Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
  const auto op = Opcode(o.op);
  KOG_CHECK(op == Opcode::kEmbed || op == Opcode::kLinear, "program: op ", i, " (opcode ", o.op,
            ") cannot read a ", info.name, " weight: only EMBED and LINEAR take quantized weights");
  KOG_CHECK(d.dtype == DType::kF32, "program: op ", i, " reads a ", info.name, " weight but the run dtype is ",
            dtype_name(d.dtype), " (quantized weights run with f32 activations)");
  const int64_t k = op == Opcode::kEmbed ? d.hidden : buffer_width(d, o.in);
  KOG_CHECK(k % info.elems == 0, "program: op ", i, " has rows of ", k, " elements, not whole ", info.name,
            " blocks of ", info.elems);
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
  KOG_CHECK(o.residual == -1 || op == Opcode::kRmsNorm, "program: op ", i, " has a residual but is not RMS_NORM");
  KOG_CHECK(op == Opcode::kKvAppend || o.out >= 0, "program: op ", i, " writes no buffer");
  KOG_CHECK(!needs_weight(op) || o.w0 != nullptr, "program: op ", i, " has no weight");
  KOG_CHECK(op != Opcode::kQkNorm || o.w1 != nullptr, "program: op ", i, " needs q and k norm weights");
  KOG_CHECK(op != Opcode::kLinear || o.out != int32_t(Buffer::kTokens), "program: op ", i,
            " writes the token buffer");
  check_weight_type(o, i, d);
  check_moe(o, i, d);
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
}

void validate_program(const std::vector<Op>& ops, const ModelDims& d) {
  KOG_CHECK(!ops.empty(), "program: no ops");
  for (size_t i = 0; i < ops.size(); ++i) check_op(ops[i], i, d);
  KOG_CHECK(Opcode(ops.back().op) == Opcode::kSample, "program: the last op must be SAMPLE");
}

}  // namespace kog::schedule
