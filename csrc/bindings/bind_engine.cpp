// kog._C.DecodeExecutor: the CPU decode executor (csrc/engine/). Raw addresses in, GIL released
// while a step runs. kog/models/decode.py builds it from the schedule and owns what it points to.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "common/errors.h"
#include "engine/decode_executor.h"

namespace py = pybind11;
using kog::engine::DecodeExecutor;

namespace {

// (opcode, layer, in, residual, out, w0, w1) per instruction.
using RawInstruction = std::tuple<int, int, int, int, int, uintptr_t, uintptr_t>;

DecodeExecutor* make_executor(py::dict dims, uintptr_t kv_base, int64_t num_blocks, int64_t block_size,
                              std::vector<float> inv_freq, const std::vector<RawInstruction>& raw) {
  kog::engine::ModelDims d{};
  d.n_layers = dims["n_layers"].cast<int64_t>();
  d.hidden = dims["hidden"].cast<int64_t>();
  d.n_q_heads = dims["n_q_heads"].cast<int64_t>();
  d.n_kv_heads = dims["n_kv_heads"].cast<int64_t>();
  d.head_dim = dims["head_dim"].cast<int64_t>();
  d.intermediate = dims["intermediate"].cast<int64_t>();
  d.vocab = dims["vocab"].cast<int64_t>();
  d.rotary_dim = int64_t(inv_freq.size()) * 2;
  d.rms_eps = dims["rms_eps"].cast<float>();
  d.attn_scale = dims["attn_scale"].cast<float>();
  d.rope_neox = dims["rope_neox"].cast<bool>();
  const int code = dims["dtype"].cast<int>();
  KOG_CHECK(code >= 0 && code <= 2, "DecodeExecutor: dtype code ", code, " is not a float type");
  d.dtype = static_cast<kog::DType>(code);
  std::vector<kog::engine::Instruction> program;
  program.reserve(raw.size());
  for (const auto& [op, layer, in, res, out, w0, w1] : raw)
    program.push_back({static_cast<kog::schedule::Opcode>(op), layer, in, res, out,
                       reinterpret_cast<const void*>(w0), reinterpret_cast<const void*>(w1)});
  return new DecodeExecutor(d, {reinterpret_cast<void*>(kv_base), num_blocks, block_size},
                            std::move(inv_freq), std::move(program));
}

void run(DecodeExecutor& ex, int64_t batch, uintptr_t tokens, uintptr_t positions,
         uintptr_t block_tables, int64_t max_blocks, uintptr_t seq_lens, uintptr_t slots,
         uintptr_t logits, uintptr_t sampled, int64_t stop_after) {
  kog::engine::DecodeStep s{batch,
                            reinterpret_cast<const int64_t*>(tokens),
                            reinterpret_cast<const int64_t*>(positions),
                            reinterpret_cast<const int32_t*>(block_tables),
                            max_blocks,
                            reinterpret_cast<const int32_t*>(seq_lens),
                            reinterpret_cast<const int64_t*>(slots),
                            reinterpret_cast<float*>(logits),
                            reinterpret_cast<int64_t*>(sampled)};
  ex.run(s, stop_after);
}

}  // namespace

void bind_engine(py::module_& m) {
  using py::arg;
  py::class_<DecodeExecutor>(m, "DecodeExecutor")
      .def(py::init(&make_executor), arg("dims"), arg("kv_base"), arg("num_blocks"), arg("block_size"),
           arg("inv_freq"), arg("program"))
      .def("run", &run, arg("batch"), arg("tokens"), arg("positions"), arg("block_tables"),
           arg("max_blocks"), arg("seq_lens"), arg("slots"), arg("logits"), arg("sampled"),
           arg("stop_after") = -1, py::call_guard<py::gil_scoped_release>())
      .def("read_buffer",
           [](const DecodeExecutor& ex, int buffer, uintptr_t dst, int64_t nbytes) {
             ex.read_buffer(static_cast<kog::schedule::Buffer>(buffer), reinterpret_cast<void*>(dst), nbytes);
           },
           arg("buffer"), arg("dst"), arg("nbytes"))
      .def("width", [](const DecodeExecutor& ex, int b) { return ex.width(static_cast<kog::schedule::Buffer>(b)); })
      .def_property_readonly("num_instructions", &DecodeExecutor::num_instructions);
}
