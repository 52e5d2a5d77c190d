// The model program's types (kog._C.ModelDims, kog._C.Op) and the numbering Python mirrors:
// opcodes, buffer ids, dtype codes and the sampling-row layout, exported so the mirrors are
// checked against C++ itself (tests/cpu/test_schedule.py, test_gpu_program.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/errors.h"
#include "schedule/program.h"
#include "schedule/sampling_row.h"

namespace py = pybind11;
using kog::schedule::Buffer;
using kog::schedule::ModelDims;
using kog::schedule::Op;
using kog::schedule::Opcode;

namespace {

ModelDims make_dims(int64_t n_layers, int64_t hidden, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                    int64_t intermediate, int64_t vocab, int64_t rotary_dim, float rms_eps, float attn_scale,
                    bool rope_neox, int dtype, int64_t n_experts, int64_t top_k, int64_t expert_intermediate,
                    bool norm_topk, int64_t shared_slots, int64_t n_lanes, bool lane_norm_weights,
                    int64_t lane_hist_slots, int64_t lane_ranks, int64_t lane_rank) {
  KOG_CHECK(dtype >= 0 && dtype <= int(kog::DType::kI64), "ModelDims: unknown dtype code ", dtype);
  ModelDims d{n_layers, hidden, n_q_heads, n_kv_heads, head_dim, intermediate, vocab, rotary_dim,
              rms_eps, attn_scale, rope_neox, kog::DType(dtype), n_experts, top_k, expert_intermediate,
              norm_topk, shared_slots, n_lanes, lane_norm_weights, lane_hist_slots,
              lane_ranks, lane_rank};
  kog::schedule::validate_dims(d);
  return d;
}

Op make_op(int op, int layer, int in, int residual, int out, uintptr_t w0, uintptr_t w1,
           const std::vector<int>& deps, uintptr_t w2, int w_type, int w1_type, int lanes, int slot, int window,
           int vocab_slice, uintptr_t expert_ranks, uintptr_t w_scale, int comm, int comm_push) {
  KOG_CHECK(deps.size() <= size_t(kog::schedule::kMaxDeps), "Op: ", deps.size(), " deps (at most ",
            kog::schedule::kMaxDeps, ")");
  Op o{op, layer, in, residual, out, int32_t(deps.size()), reinterpret_cast<const void*>(w0),
       reinterpret_cast<const void*>(w1), {}, reinterpret_cast<const void*>(w2), w_type, w1_type, lanes, slot, window,
       vocab_slice, reinterpret_cast<const int32_t*>(expert_ranks), reinterpret_cast<const void*>(w_scale), comm,
       comm_push};
  for (size_t k = 0; k < deps.size(); ++k) o.deps[k] = deps[k];
  return o;
}

std::vector<int> deps_of(const Op& o) { return std::vector<int>(o.deps, o.deps + o.n_deps); }

py::tuple field(size_t offset, size_t size) { return py::make_tuple(offset, size); }

}  // namespace

void bind_schedule(py::module_& m) {
  using py::arg;
  py::class_<ModelDims>(m, "ModelDims", "The shape of one model, as every executor takes it (validated).")
      .def(py::init(&make_dims), arg("n_layers"), arg("hidden"), arg("n_q_heads"), arg("n_kv_heads"),
           arg("head_dim"), arg("intermediate"), arg("vocab"), arg("rotary_dim"), arg("rms_eps"),
           arg("attn_scale"), arg("rope_neox"), arg("dtype"), arg("n_experts") = 0, arg("top_k") = 0,
           arg("expert_intermediate") = 0, arg("norm_topk") = false, arg("shared_slots") = 0, arg("n_lanes") = 1,
           arg("lane_norm_weights") = false, arg("lane_hist_slots") = 0, arg("lane_ranks") = 1, arg("lane_rank") = 0)
      .def_readonly("n_layers", &ModelDims::n_layers)
      .def_readonly("hidden", &ModelDims::hidden)
      .def_readonly("n_q_heads", &ModelDims::n_q_heads)
      .def_readonly("n_kv_heads", &ModelDims::n_kv_heads)
      .def_readonly("head_dim", &ModelDims::head_dim)
      .def_readonly("intermediate", &ModelDims::intermediate)
      .def_readonly("vocab", &ModelDims::vocab)
      .def_readonly("rotary_dim", &ModelDims::rotary_dim)
      .def_readonly("rms_eps", &ModelDims::rms_eps)
      .def_readonly("attn_scale", &ModelDims::attn_scale)
      .def_readonly("rope_neox", &ModelDims::rope_neox)
      .def_readonly("n_experts", &ModelDims::n_experts)
      .def_readonly("top_k", &ModelDims::top_k)
      .def_readonly("expert_intermediate", &ModelDims::expert_intermediate)
      .def_readonly("norm_topk", &ModelDims::norm_topk)
      .def_readonly("shared_slots", &ModelDims::shared_slots)
      .def_readonly("n_lanes", &ModelDims::n_lanes)
      .def_readonly("lane_norm_weights", &ModelDims::lane_norm_weights)
      .def_readonly("lane_hist_slots", &ModelDims::lane_hist_slots)
      .def_readonly("lane_ranks", &ModelDims::lane_ranks)
      .def_readonly("lane_rank", &ModelDims::lane_rank)
      .def_property_readonly("dtype", [](const ModelDims& d) { return int(d.dtype); })
      .def("buffer_width", [](const ModelDims& d, int b) {
             KOG_CHECK(b >= 0 && b < int(Buffer::kNumBuffers), "buffer_width: bad buffer ", b);
             return kog::schedule::buffer_width(d, b);
           }, arg("buffer"), "Elements per batch row of a buffer (TOKENS: 1 int32).");

  py::class_<Op>(m, "Op", "One op of the program with resolved operands (csrc/schedule/program.h).")
      .def(py::init(&make_op), arg("opcode"), arg("layer"), arg("in_"), arg("residual"), arg("out"), arg("w0"),
           arg("w1"), arg("deps"), arg("w2") = 0, arg("w_type") = kog::schedule::kWeightRunDtype,
           arg("w1_type") = kog::schedule::kWeightRunDtype, arg("lanes") = 1, arg("slot") = -1, arg("window") = 0,
           arg("vocab_slice") = 0, arg("expert_ranks") = 0, arg("w_scale") = 0, arg("comm") = -1, arg("comm_push") = 0)
      .def_readonly("opcode", &Op::op)
      .def_readonly("layer", &Op::layer)
      .def_readonly("in_", &Op::in)
      .def_readonly("residual", &Op::residual)
      .def_readonly("out", &Op::out)
      .def_property_readonly("w0", [](const Op& o) { return reinterpret_cast<uintptr_t>(o.w0); })
      .def_property_readonly("w1", [](const Op& o) { return reinterpret_cast<uintptr_t>(o.w1); })
      .def_property_readonly("w2", [](const Op& o) { return reinterpret_cast<uintptr_t>(o.w2); },
                             "A GEMV's RMSNorm prologue weight (expanded GPU programs only), else 0.")
      .def_property_readonly("deps", &deps_of)
      .def_readonly("w_type", &Op::w_type)
      .def_readonly("w1_type", &Op::w1_type)
      .def_readonly("lanes", &Op::lanes)
      .def_readonly("slot", &Op::slot)
      .def_readonly("window", &Op::window)
      .def_readonly("vocab_slice", &Op::vocab_slice)
      .def_readonly("comm", &Op::comm, "A cross-rank op's channel (expanded GPU programs of a rank only), else -1.")
      .def_readonly("comm_push", &Op::comm_push, "1: the push half of a cross-rank op; 0: its finish (or none).")
      .def_property_readonly("w_scale", [](const Op& o) { return reinterpret_cast<uintptr_t>(o.w_scale); },
                             "A GPU weight format's scales (w_type WEIGHT_FP8: [rows] f32; WEIGHT_Q4_GROUPS: "
                             "[rows, k / 32] f16 pairs; WEIGHT_Q4_K: [rows, k / 256] 16-byte headers), else 0.")
      .def("__repr__", [](const Op& o) {
        std::string deps;
        for (int k = 0; k < o.n_deps; ++k) deps += (k ? ", " : "") + std::to_string(o.deps[k]);
        return "Op(opcode=" + std::to_string(o.op) + ", layer=" + std::to_string(o.layer) + ", in_=" +
               std::to_string(o.in) + ", residual=" + std::to_string(o.residual) + ", out=" +
               std::to_string(o.out) + ", deps=[" + deps + "], w_type=" + std::to_string(o.w_type) + ", lanes=" + std::to_string(o.lanes) + ", slot=" +
               std::to_string(o.slot) + ")";
      });
  m.def("validate_program", &kog::schedule::validate_program, arg("ops"), arg("dims"),
        "Raises InvalidRequest naming the first bad op (opcode, layer, buffers, weights, deps).");
  m.attr("PROGRAM_MAX_DEPS") = kog::schedule::kMaxDeps;
  m.attr("WEIGHT_RUN_DTYPE") = kog::schedule::kWeightRunDtype;
  m.attr("WEIGHT_FP8") = kog::schedule::kWeightFp8;
  m.attr("WEIGHT_Q4_GROUPS") = kog::schedule::kWeightQ4Groups;
  m.attr("WEIGHT_Q4_K") = kog::schedule::kWeightQ4K;

  py::dict ops;
  ops["EMBED"] = int(Opcode::kEmbed);
  ops["RMS_NORM"] = int(Opcode::kRmsNorm);
  ops["LINEAR"] = int(Opcode::kLinear);
  ops["QK_NORM"] = int(Opcode::kQkNorm);
  ops["ROPE"] = int(Opcode::kRope);
  ops["KV_APPEND"] = int(Opcode::kKvAppend);
  ops["ATTN_DECODE"] = int(Opcode::kAttnDecode);
  ops["SILU_MUL"] = int(Opcode::kSiluMul);
  ops["SAMPLE"] = int(Opcode::kSample);
  ops["ROUTER"] = int(Opcode::kRouter);
  ops["MOE_EXPERTS"] = int(Opcode::kMoeExperts);
  ops["LANE_SCALE"] = int(Opcode::kLaneScale);
  ops["LANE_SUM"] = int(Opcode::kLaneSum);
  ops["LANE_GATHER"] = int(Opcode::kLaneGather);
  ops["LANE_ADD_PAST"] = int(Opcode::kLaneAddPast);
  ops["LANE_MEAN"] = int(Opcode::kLaneMean);
  ops["LANE_MERGE_SUM"] = int(Opcode::kLaneMergeSum);
  ops["ALL_REDUCE"] = int(Opcode::kAllReduce);
  ops["ALL_GATHER"] = int(Opcode::kAllGather);
  m.attr("SCHEDULE_OPCODES") = ops;
  m.attr("SCHEDULE_NUM_OPCODES") = int(Opcode::kNumOpcodes);
  py::dict bufs;
  bufs["TOKENS"] = int(Buffer::kTokens);
  bufs["HIDDEN"] = int(Buffer::kHidden);
  bufs["RESIDUAL"] = int(Buffer::kResidual);
  bufs["NORMED"] = int(Buffer::kNormed);
  bufs["QKV"] = int(Buffer::kQkv);
  bufs["ATTN"] = int(Buffer::kAttn);
  bufs["GATE_UP"] = int(Buffer::kGateUp);
  bufs["ACT"] = int(Buffer::kAct);
  bufs["LOGITS"] = int(Buffer::kLogits);
  bufs["ROUTE"] = int(Buffer::kRoute);
  bufs["MERGED"] = int(Buffer::kMerged);
  bufs["LANE_HIST"] = int(Buffer::kLaneHist);
  m.attr("SCHEDULE_BUFFERS") = bufs;
  m.attr("SCHEDULE_NUM_BUFFERS") = int(Buffer::kNumBuffers);

  // kog::DType codes by torch dtype name (kog.ops.DTYPE_CODE maps torch dtypes through it).
  py::dict dtypes;
  for (kog::DType t : {kog::DType::kF32, kog::DType::kF16, kog::DType::kBF16, kog::DType::kI32, kog::DType::kI64})
    dtypes[kog::dtype_name(t)] = int(t);
  m.attr("DTYPE_CODES") = dtypes;

  // SamplingRow: {"itemsize": bytes, "fields": {name: (offset, size)}}, in declaration order.
  using kog::schedule::SamplingRow;
  py::dict fields;
  fields["temperature"] = field(offsetof(SamplingRow, temperature), sizeof(SamplingRow::temperature));
  fields["top_k"] = field(offsetof(SamplingRow, top_k), sizeof(SamplingRow::top_k));
  fields["top_p"] = field(offsetof(SamplingRow, top_p), sizeof(SamplingRow::top_p));
  fields["min_p"] = field(offsetof(SamplingRow, min_p), sizeof(SamplingRow::min_p));
  fields["seed"] = field(offsetof(SamplingRow, seed), sizeof(SamplingRow::seed));
  py::dict layout;
  layout["itemsize"] = sizeof(SamplingRow);
  layout["fields"] = fields;
  m.attr("SAMPLING_ROW_LAYOUT") = layout;
}
