// kog._C.DecodeExecutor: the CPU decode executor (csrc/engine/). Raw addresses in, GIL released
// while a step runs. kog/models/decode.py builds it from the program and owns what it points to.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "common/errors.h"
#include "engine/decode_executor.h"
#include "engine/shm_transport.h"

namespace py = pybind11;
using kog::engine::DecodeExecutor;

namespace {

// kv_dtype: the cache's DType code; -1: the run dtype (dims.dtype).
DecodeExecutor* make_executor(const kog::schedule::ModelDims& dims, uintptr_t kv_base, int64_t num_blocks,
                              int64_t block_size, std::vector<float> inv_freq, std::vector<kog::schedule::Op> ops,
                              int kv_dtype) {
  KOG_CHECK(kv_dtype >= -1 && kv_dtype <= 2, "DecodeExecutor: kv_dtype code ", kv_dtype, " is not a float dtype");
  const kog::DType kv = kv_dtype < 0 ? dims.dtype : static_cast<kog::DType>(kv_dtype);
  return new DecodeExecutor(dims, {reinterpret_cast<void*>(kv_base), num_blocks, block_size, kv}, std::move(inv_freq),
                            std::move(ops));
}

void run(DecodeExecutor& ex, int64_t batch, uintptr_t tokens, uintptr_t positions,
         uintptr_t block_tables, int64_t max_blocks, uintptr_t seq_lens, uintptr_t slots,
         uintptr_t logits, uintptr_t sampled, int64_t stop_after, bool argmax_only) {
  kog::engine::DecodeStep s{batch,
                            reinterpret_cast<const int64_t*>(tokens),
                            reinterpret_cast<const int64_t*>(positions),
                            reinterpret_cast<const int32_t*>(block_tables),
                            max_blocks,
                            reinterpret_cast<const int32_t*>(seq_lens),
                            reinterpret_cast<const int64_t*>(slots),
                            reinterpret_cast<float*>(logits),
                            reinterpret_cast<int64_t*>(sampled),
                            argmax_only};
  ex.run(s, stop_after);
}

}  // namespace

void bind_engine(py::module_& m) {
  using py::arg;
  py::class_<DecodeExecutor>(m, "DecodeExecutor")
      .def(py::init(&make_executor), arg("dims"), arg("kv_base"), arg("num_blocks"), arg("block_size"),
           arg("inv_freq"), arg("ops"), arg("kv_dtype") = -1)
      .def("run", &run, arg("batch"), arg("tokens"), arg("positions"), arg("block_tables"),
           arg("max_blocks"), arg("seq_lens"), arg("slots"), arg("logits"), arg("sampled"),
           arg("stop_after") = -1, arg("argmax_only") = false, py::call_guard<py::gil_scoped_release>())
      .def("read_buffer",
           [](const DecodeExecutor& ex, int buffer, uintptr_t dst, int64_t nbytes) {
             ex.read_buffer(static_cast<kog::schedule::Buffer>(buffer), reinterpret_cast<void*>(dst), nbytes);
           },
           arg("buffer"), arg("dst"), arg("nbytes"))
      .def("width", [](const DecodeExecutor& ex, int b) {
             KOG_CHECK(b >= 0 && b < int(kog::schedule::Buffer::kNumBuffers), "width: bad buffer ", b);
             return ex.width(static_cast<kog::schedule::Buffer>(b));
           })
      .def_property_readonly("num_ops", &DecodeExecutor::num_ops)
      .def_property_readonly("num_barriers", &DecodeExecutor::num_barriers)
      .def_property_readonly("num_zero_copy_publishes", &DecodeExecutor::num_zero_copy_publishes)
      .def_property_readonly("num_argmax_gathers", &DecodeExecutor::num_argmax_gathers)
      .def("set_transport", &DecodeExecutor::set_transport, arg("transport"),
           "A tensor-parallel rank's kog._C.ShmTransport (dims.lane_ranks > 1).");
}
