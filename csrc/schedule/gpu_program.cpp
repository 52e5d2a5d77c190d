// The GPU's expanded program. Contract: gpu_program.h.
#include "schedule/gpu_program.h"

#include <algorithm>

#include "common/errors.h"
#include "schedule/moe_route.h"

namespace kog::schedule {

namespace {

void add_dep(Op& o, int32_t d) {
  for (int k = 0; k < o.n_deps; ++k)
    if (o.deps[k] == d) return;
  KOG_CHECK(o.n_deps < kMaxDeps, "gpu program: an op needs more than ", kMaxDeps, " deps");
  o.deps[o.n_deps++] = d;
  std::sort(o.deps, o.deps + o.n_deps);
}

bool reads(const Op& o, int32_t b) { return b >= 0 && (o.in == b || o.residual == b); }
bool writes(const Op& o, int32_t b) {
  return b >= 0 && (o.out == b || (o.residual == b && Opcode(o.op) == Opcode::kRmsNorm));
}
bool touches(const Op& o, int32_t b) { return reads(o, b) || writes(o, b); }

}  // namespace

void fuse_residual_adds(std::vector<Op>& ops) {
  const int n = int(ops.size());
  for (int i = 0; i < n; ++i) {
    Op& norm = ops[size_t(i)];
    if (Opcode(norm.op) != Opcode::kRmsNorm || norm.residual < 0) continue;
    const int32_t x = norm.in, r = norm.residual;
    int j = i - 1;  // the last op before the norm that touches x or r: must be x's producer
    while (j >= 0 && !touches(ops[size_t(j)], x) && !touches(ops[size_t(j)], r)) --j;
    if (j < 0) continue;
    Op& lin = ops[size_t(j)];
    if (Opcode(lin.op) != Opcode::kLinear || lin.out != x || lin.residual >= 0 || reads(lin, r)) continue;
    int k = i + 1;  // x must not be read after the norm before it is written again
    while (k < n && !touches(ops[size_t(k)], x)) ++k;
    if (k < n && reads(ops[size_t(k)], x)) continue;
    int prev = j - 1;  // WAR/WAW on r: the LINEAR now writes it
    while (prev >= 0 && !touches(ops[size_t(prev)], r)) --prev;
    if (prev >= 0) add_dep(lin, prev);
    lin.out = r;
    lin.residual = r;
    norm.in = r;
    norm.residual = -1;
  }
}

// fused_into[i] = j when SILU_MUL op i folds into LINEAR op j (-1 otherwise): j writes i's input,
// nothing else touches that buffer in between or reads it after i, and nothing in between touches
// i's output (which j now writes earlier).
std::vector<int32_t> silu_mul_fusions(const std::vector<Op>& ops) {
  const int n = int(ops.size());
  std::vector<int32_t> fused_into(ops.size(), -1);
  for (int i = 0; i < n; ++i) {
    const Op& s = ops[size_t(i)];
    if (Opcode(s.op) != Opcode::kSiluMul) continue;
    int j = i - 1;
    while (j >= 0 && !touches(ops[size_t(j)], s.in) && !touches(ops[size_t(j)], s.out)) --j;
    if (j < 0) continue;
    const Op& l = ops[size_t(j)];
    if (Opcode(l.op) != Opcode::kLinear || l.out != s.in || l.residual >= 0 || reads(l, s.out)) continue;
    int k = i + 1;  // the gate/up values exist only in registers once fused: no later reader
    while (k < n && !touches(ops[size_t(k)], s.in)) ++k;
    if (k < n && reads(ops[size_t(k)], s.in)) continue;
    bool ordered = true;  // the fused op runs at j: every dep of the SILU_MUL must precede j
    for (int d = 0; d < s.n_deps; ++d) ordered &= s.deps[d] <= j;
    if (ordered) fused_into[size_t(i)] = j;
  }
  return fused_into;
}

// Marks in fused_into the ROPE and KV_APPEND that fold into the LINEAR writing QKV just before
// them (l, l + 1, l + 2: the family functions emit them together): no QK_NORM in between (it
// needs a whole head), every dimension rotated, and every dep of the two before l.
void rope_kv_fusions(const std::vector<Op>& ops, const ModelDims& dims, std::vector<int32_t>& fused_into) {
  if (dims.rotary_dim != dims.head_dim) return;
  for (size_t l = 0; l + 2 < ops.size(); ++l) {
    const Op &lin = ops[l], &rope = ops[l + 1], &kv = ops[l + 2];
    if (Opcode(lin.op) != Opcode::kLinear || lin.residual >= 0 || Opcode(rope.op) != Opcode::kRope ||
        Opcode(kv.op) != Opcode::kKvAppend || rope.in != lin.out || kv.in != lin.out)
      continue;
    bool ordered = true;
    for (const Op* o : {&rope, &kv})
      for (int d = 0; d < o->n_deps; ++d) ordered &= o->deps[d] <= int32_t(l) || o->deps[d] == int32_t(l) + 1;
    if (!ordered) continue;
    fused_into[l + 1] = fused_into[l + 2] = int32_t(l);
  }
}

// RMS_NORM ops (no residual add left: fuse_residual_adds ran) that fold FORWARD into the prologue
// of the LINEAR reading their output: consumer[i] = j. The LINEAR then reads the norm's input and
// normalizes it (w2 = the norm's weight) and takes the norm's deps in place of its dep on it.
// Conditions: j is the first op after i that touches the norm's output, a LINEAR reading it
// with no residual of its own, not writing the norm's input; nothing in (i, j) writes the
// norm's input (j reads it later than the norm did) or depends on i (i's completion is now j's,
// which comes after them); nothing after j reads the norm's output before it is written again
// (it is never written now). Not with lanes: a lane LINEAR (each row reads its lane's slice of x)
// or a lane-wide norm (each lane normalized on its own) keeps its RMS_NORM op.
std::vector<int32_t> rmsnorm_prologue_fusions(std::vector<Op>& ops, const ModelDims& dims) {
  const int n = int(ops.size());
  std::vector<int32_t> consumer(ops.size(), -1);
  for (int i = 0; i < n; ++i) {
    const Op& norm = ops[size_t(i)];
    if (Opcode(norm.op) != Opcode::kRmsNorm || norm.residual >= 0) continue;
    bool ok = true;
    int j = i + 1;
    for (; j < n && !touches(ops[size_t(j)], norm.out); ++j) {
      const Op& o = ops[size_t(j)];
      ok &= !writes(o, norm.in) && std::find(o.deps, o.deps + o.n_deps, i) == o.deps + o.n_deps;
    }
    if (!ok || j >= n) continue;
    const Op& lin = ops[size_t(j)];
    if (Opcode(lin.op) != Opcode::kLinear || lin.in != norm.out || lin.residual >= 0 || lin.out == norm.in ||
        lin.out == norm.out || lin.lanes > 1 || (dims.n_lanes > 1 && buffer_width(dims, norm.out) != dims.hidden))
      continue;
    int k = j + 1;
    while (k < n && !touches(ops[size_t(k)], norm.out)) ++k;
    if (k < n && reads(ops[size_t(k)], norm.out)) continue;
    consumer[size_t(i)] = j;
    Op& l = ops[size_t(j)];
    const Op norm_copy = norm;
    int32_t kept[kMaxDeps], n_kept = 0;  // l's deps without the norm, then the norm's
    for (int d = 0; d < l.n_deps; ++d)
      if (l.deps[d] != i) kept[n_kept++] = l.deps[d];
    l.n_deps = 0;
    for (int d = 0; d < n_kept; ++d) add_dep(l, kept[d]);
    for (int d = 0; d < norm_copy.n_deps; ++d) add_dep(l, norm_copy.deps[d]);
    l.in = norm_copy.in;
    l.w2 = norm_copy.w0;
  }
  return consumer;
}

std::vector<Op> expand_gpu_program(const std::vector<Op>& ops_in, const ModelDims& dims) {
  validate_program(ops_in, dims);
  // NOTE: the persistent kernel's GEMV streams run-dtype weights and the GPU formats (FP8, 4-bit
  // groups, Q4_K: kog.int4 converts GGUF Q4_0 / Q4_1 / Q4_K blocks); it has no GEMV or embedding
  // over other ggml blocks.
  for (size_t i = 0; i < ops_in.size(); ++i)
    KOG_CHECK(ops_in[i].w_type == kWeightRunDtype || is_gpu_weight_format(ops_in[i].w_type), "GPU decode program: op ",
              i, " reads a quantized weight (ggml type ", ops_in[i].w_type,
              ") in a layout the GPU kernel does not read; convert Q4_0 / Q4_1 / Q4_K matrices with "
              "kog.int4.to_gpu_weights, or load the model with dtype=\"bfloat16\" or quantization=\"fp8\"");
  // Mixture of experts: run-dtype experts (to_gpu_weights dequantizes quantized stacks) and what
  // the router tail holds (moe_route.h). On tensor-parallel ranks the placement (Op::expert_ranks)
  // becomes the executor's MoeScratch::expert_local.
  for (size_t i = 0; i < ops_in.size(); ++i) {
    const Op& o = ops_in[i];
    const auto op = Opcode(o.op);
    if (op != Opcode::kRouter && op != Opcode::kMoeExperts) continue;
    const char* name = op == Opcode::kRouter ? "ROUTER" : "MOE_EXPERTS";
    KOG_CHECK(o.w_type == kWeightRunDtype && o.w1_type == kWeightRunDtype, "GPU decode program: op ", i, " (", name,
              ") reads quantized expert weights (ggml types ", o.w_type, ", ", o.w1_type,
              "); the GPU kernel's experts are in the run dtype (kog.int4.to_gpu_weights dequantizes them)");
    KOG_CHECK(moe_slots(dims) <= kMaxMoeSlots && router_rows(dims) <= kMaxRouterRows, "GPU decode program: op ", i,
              " (", name, "): ", moe_slots(dims), " slots per row (top_k + shared_slots, at most ", kMaxMoeSlots,
              ") and ", router_rows(dims), " router rows (at most ", kMaxRouterRows, ") for the GPU kernel");
  }
  // Lanes (and tensor-parallel ranks, which are lanes on ranks) in the float kernels only (the
  // quantized one has no registers left for them: docs/GPU.md).
  if (dims.n_lanes > 1 || dims.lane_ranks > 1) {
    for (size_t i = 0; i < ops_in.size(); ++i)
      KOG_CHECK(!is_gpu_weight_format(ops_in[i].w_type), "GPU decode program: op ", i,
                " reads an FP8 or 4-bit weight in a model of ", dims.n_lanes * dims.lane_ranks, " lanes over ",
                dims.lane_ranks, " ranks; the GPU kernel runs lanes with run-dtype weights only");
  }
  std::vector<Op> ops = ops_in;
  fuse_residual_adds(ops);
  const std::vector<int32_t> norm_consumer = rmsnorm_prologue_fusions(ops, dims);
  std::vector<int32_t> folded_norm(ops.size(), -1);  // the inverse: LINEAR j -> the norm in its prologue
  for (size_t i = 0; i < ops.size(); ++i)
    if (norm_consumer[i] >= 0) folded_norm[size_t(norm_consumer[i])] = int32_t(i);
  std::vector<int32_t> fused_into = silu_mul_fusions(ops);
  rope_kv_fusions(ops, dims, fused_into);
  for (size_t i = 0; i < ops.size(); ++i) {
    const int32_t into = fused_into[i];
    if (into < 0) continue;
    Op& l = ops[size_t(into)];
    switch (Opcode(ops[i].op)) {
      case Opcode::kSiluMul: l.op = kOpLinearSiluMul, l.out = ops[i].out; break;
      case Opcode::kRope: l.op = kOpLinearRopeKv; break;
      default: l.layer = ops[i].layer; break;  // KV_APPEND: the cache layer it writes
    }
    for (int k = 0; k < ops[i].n_deps; ++k) {  // WAR on what it now writes, and the rest
      const int32_t d = ops[i].deps[k];
      if (d != into && fused_into[size_t(d)] != into) add_dep(l, d);
    }
  }
  // produced[i]: the expanded index whose completion means op i's output is complete.
  std::vector<int32_t> produced(ops.size(), -1);
  std::vector<Op> out;
  out.reserve(ops.size() + 1);
  int32_t last_attn = -1;
  int32_t n_channels = 0;
  std::vector<int32_t> slot_channel(size_t(std::max<int64_t>(dims.lane_hist_slots, 0)), -1);  // LANE_HIST slot -> its gather's
  for (size_t i = 0; i < ops.size(); ++i) {
    if (fused_into[i] >= 0) {  // folded into an earlier LINEAR: its dependents wait for that one
      produced[i] = produced[size_t(fused_into[i])];
      continue;
    }
    if (norm_consumer[i] >= 0) continue;  // folded into a later LINEAR: produced when that one is
    Op o = ops[i];
    o.n_deps = 0;
    for (int k = 0; k < ops[i].n_deps; ++k) {
      const int32_t d = produced[size_t(ops[i].deps[k])];
      KOG_ASSERT(d >= 0, "expand_gpu_program: op ", i, " depends on op ", ops[i].deps[k], " before it exists");
      add_dep(o, d);
    }
    if (Opcode(o.op) == Opcode::kRouter) o.op = kOpRouterGemv;
    if (Opcode(o.op) == Opcode::kMoeExperts) {  // gate/up (MOE_EXPERTS' deps) -> down -> combine
      o.op = kOpMoeGateUp;
      const int32_t writes_to = o.out;
      o.out = -1;
      out.push_back(o);
      Op down = o;
      down.op = kOpMoeDown, down.in = down.residual = -1, down.n_deps = 0;
      add_dep(down, int32_t(out.size()) - 1);
      out.push_back(down);
      Op combine = down;
      combine.op = kOpMoeCombine, combine.out = writes_to, combine.w0 = combine.w1 = nullptr, combine.n_deps = 0;
      add_dep(combine, int32_t(out.size()) - 1);
      out.push_back(combine);
      produced[i] = int32_t(out.size()) - 1;
      continue;
    }
    const bool attn = Opcode(o.op) == Opcode::kAttnDecode;
    if (attn && last_attn >= 0) add_dep(o, last_attn);
    const auto opc = Opcode(o.op);
    if (dims.lane_ranks > 1 && (opc == Opcode::kLaneSum || opc == Opcode::kLaneMean || opc == Opcode::kLaneMergeSum ||
                                opc == Opcode::kAllReduce || opc == Opcode::kAllGather || opc == Opcode::kLaneGather)) {
      Op push = o;  // reads what the op reads; writes only the channel's inboxes
      push.comm = n_channels++, push.comm_push = 1, push.out = -1;
      out.push_back(push);
      if (opc == Opcode::kLaneGather) {  // the LANE_ADD_PAST reading its slot finishes it
        KOG_CHECK(o.slot >= 0 && o.slot < int32_t(slot_channel.size()), "GPU decode program: op ", i,
                  " (LANE_GATHER) writes slot ", o.slot, " of ", slot_channel.size());
        slot_channel[size_t(o.slot)] = push.comm;
        produced[i] = int32_t(out.size()) - 1;
        continue;
      }
      o.comm = push.comm;  // the finish: the op's own deps and the push
      add_dep(o, int32_t(out.size()) - 1);
    }
    if (dims.lane_ranks > 1 && opc == Opcode::kLaneAddPast) {
      const int32_t c = o.slot >= 0 && o.slot < int32_t(slot_channel.size()) ? slot_channel[size_t(o.slot)] : -1;
      KOG_CHECK(c >= 0, "GPU decode program: op ", i, " (LANE_ADD_PAST) reads slot ", o.slot,
                " before any LANE_GATHER wrote it");
      o.comm = c;
    }
    if (Opcode(o.op) == Opcode::kSample) {  // its first phase runs in the tails of the LM head's items
      int32_t head = int32_t(out.size()) - 1;
      while (head >= 0 && out[size_t(head)].out != o.in) --head;
      bool waits = false;
      for (int k = 0; k < o.n_deps; ++k) waits |= o.deps[k] == head;
      const Op* h = head >= 0 ? &out[size_t(head)] : nullptr;
      // (a tensor-parallel rank: in the finish of the logits' gather or reduce, which runs it itself)
      const bool finish = h != nullptr && is_logits_finish(*h);
      KOG_CHECK(h != nullptr && waits && (finish || (Opcode(h->op) == Opcode::kLinear && h->residual < 0)),
                "GPU decode program: op ", i, " (SAMPLE) must read the output of a LINEAR it depends on (the LM head)",
                dims.lane_ranks > 1 ? " or of the logits' ALL_GATHER / ALL_REDUCE" : "");
      if (!finish) out[size_t(head)].op = kOpLinearSamplePartial;
    }
    out.push_back(o);
    produced[i] = int32_t(out.size()) - 1;
    if (folded_norm[i] >= 0) produced[size_t(folded_norm[i])] = produced[i];  // completes with its consumer
    if (attn) last_attn = produced[i];
  }
  return out;
}

CommLayout comm_layout(const std::vector<Op>& ops, const ModelDims& dims, int64_t batch) {
  CommLayout l;
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& o = ops[i];
    if (o.comm < 0 || !o.comm_push) continue;
    KOG_CHECK(o.comm == int32_t(l.part.size()), "comm_layout: op ", i, " pushes channel ", o.comm, " where channel ",
              l.part.size(), " comes next");
    const int64_t part = (comm_part_bytes(dims, o, batch) + 255) / 256 * 256;
    l.offset.push_back(l.parity_bytes);
    l.part.push_back(part);
    l.parity_bytes += part * dims.lane_ranks;
  }
  return l;
}

std::vector<int32_t> program_sinks(const std::vector<Op>& ops) {
  std::vector<char> has_dependent(ops.size(), 0);
  for (const Op& o : ops)
    for (int k = 0; k < o.n_deps; ++k) has_dependent[size_t(o.deps[k])] = 1;
  std::vector<int32_t> sinks;
  for (size_t i = 0; i < ops.size(); ++i)
    if (!has_dependent[i]) sinks.push_back(int32_t(i));
  // Deps point backwards, so nothing can depend on the last op.
  KOG_ASSERT(ops.empty() || (!sinks.empty() && size_t(sinks.back()) == ops.size() - 1),
             "program_sinks: the last op has a dependent");
  return sinks;
}

}  // namespace kog::schedule
