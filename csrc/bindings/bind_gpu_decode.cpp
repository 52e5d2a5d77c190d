// kog._C.expand_gpu_program (every build: the GPU program builder is tested on the CPU) and
// kog._C.GpuDecodeExecutor (the persistent decode kernel; raises BackendError in a CPU build).
// Raw device addresses in; kog/models/gpu_decode.py owns what they point to.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "common/errors.h"
#include "schedule/gpu_program.h"
#ifdef KOG_WITH_GPU
#include "gpu/decode/executor.h"
#endif

namespace py = pybind11;
using kog::schedule::GpuOp;

namespace {

// (opcode, layer, in, residual, out, w0, w1) per op, as kog/models/decode.py resolves them.
using RawOp = std::tuple<int, int, int, int, int, uintptr_t, uintptr_t>;

std::vector<GpuOp> to_ops(const std::vector<RawOp>& raw) {
  std::vector<GpuOp> ops;
  ops.reserve(raw.size());
  for (const auto& [op, layer, in, res, out, w0, w1] : raw)
    ops.push_back({op, layer, in, res, out, 0, reinterpret_cast<const void*>(w0), reinterpret_cast<const void*>(w1)});
  return ops;
}

std::vector<RawOp> from_ops(const std::vector<GpuOp>& ops) {
  std::vector<RawOp> raw;
  raw.reserve(ops.size());
  for (const GpuOp& o : ops)
    raw.emplace_back(o.op, o.layer, o.in, o.residual, o.out, reinterpret_cast<uintptr_t>(o.w0),
                     reinterpret_cast<uintptr_t>(o.w1));
  return raw;
}

#ifdef KOG_WITH_GPU
using kog::gpu::decode::GpuDecodeExecutor;

std::unique_ptr<GpuDecodeExecutor> make_executor(py::dict dims, uintptr_t kv_base, int64_t num_blocks,
                                                 int32_t block_size, uintptr_t inv_freq, int32_t rotary_dim,
                                                 const std::vector<RawOp>& raw) {
  kog::gpu::decode::GpuModelDims d{};
  d.n_layers = dims["n_layers"].cast<int32_t>();
  d.hidden = dims["hidden"].cast<int32_t>();
  d.n_q_heads = dims["n_q_heads"].cast<int32_t>();
  d.n_kv_heads = dims["n_kv_heads"].cast<int32_t>();
  d.head_dim = dims["head_dim"].cast<int32_t>();
  d.intermediate = dims["intermediate"].cast<int32_t>();
  d.vocab = dims["vocab"].cast<int32_t>();
  d.rotary_dim = rotary_dim;
  d.rms_eps = dims["rms_eps"].cast<float>();
  d.attn_scale = dims["attn_scale"].cast<float>();
  d.rope_neox = dims["rope_neox"].cast<bool>();
  const int code = dims["dtype"].cast<int>();
  KOG_CHECK(code >= 0 && code <= 2, "GpuDecodeExecutor: dtype code ", code, " is not a float type");
  d.dtype = static_cast<kog::DType>(code);
  const auto ops = kog::schedule::expand_gpu_program(to_ops(raw), d.n_layers);
  return std::make_unique<GpuDecodeExecutor>(d, kog::gpu::decode::GpuKVCache{reinterpret_cast<void*>(kv_base),
                                                                              num_blocks, block_size},
                                             reinterpret_cast<const float*>(inv_freq), ops);
}

template <typename P>
P* ptr(uintptr_t a) {
  return reinterpret_cast<P*>(a);
}

void run(GpuDecodeExecutor& ex, int32_t batch, int32_t n_steps, uintptr_t tokens, uintptr_t positions,
         uintptr_t seq_lens, uintptr_t slots, uintptr_t block_tables, int32_t max_blocks, int32_t max_seq_len,
         uintptr_t sampling, uint64_t rng_step, uintptr_t stop_ids, int32_t n_stop_ids, uintptr_t out_tokens,
         uintptr_t finished, uintptr_t logits, uintptr_t stream) {
  kog::gpu::decode::GpuDecodeStep s{batch,
                                    n_steps,
                                    ptr<int32_t>(tokens),
                                    ptr<int64_t>(positions),
                                    ptr<int32_t>(seq_lens),
                                    ptr<int64_t>(slots),
                                    ptr<const int32_t>(block_tables),
                                    max_blocks,
                                    max_seq_len,
                                    ptr<const kog::gpu::decode::SamplingRow>(sampling),
                                    rng_step,
                                    ptr<const int32_t>(stop_ids),
                                    n_stop_ids,
                                    ptr<int32_t>(out_tokens),
                                    ptr<int32_t>(finished),
                                    ptr<float>(logits)};
  ex.run(s, reinterpret_cast<void*>(stream));
}
#endif

}  // namespace

void bind_gpu_decode(py::module_& m) {
  using py::arg;
  m.def(
      "expand_gpu_program",
      [](const std::vector<RawOp>& raw, int32_t n_layers) {
        return from_ops(kog::schedule::expand_gpu_program(to_ops(raw), n_layers));
      },
      arg("ops"), arg("n_layers"),
      "The decode schedule as the GPU persistent kernel runs it (ATTN_DECODE split into partial + combine).");
  m.attr("GPU_OP_ATTN_COMBINE") = kog::schedule::kOpAttnCombine;
#ifdef KOG_WITH_GPU
  py::class_<GpuDecodeExecutor>(m, "GpuDecodeExecutor")
      .def(py::init(&make_executor), arg("dims"), arg("kv_base"), arg("num_blocks"), arg("block_size"),
           arg("inv_freq"), arg("rotary_dim"), arg("ops"))
      .def("run", &run, arg("batch"), arg("n_steps"), arg("tokens"), arg("positions"), arg("seq_lens"), arg("slots"),
           arg("block_tables"), arg("max_blocks"), arg("max_seq_len"), arg("sampling"), arg("rng_step"),
           arg("stop_ids"), arg("n_stop_ids"), arg("out_tokens"), arg("finished"), arg("logits"), arg("stream"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("grid_size", &GpuDecodeExecutor::grid_size)
      .def_property_readonly("num_ops", &GpuDecodeExecutor::num_ops);
  m.attr("GPU_DECODE_MAX_BATCH") = GpuDecodeExecutor::kMaxBatch;
  m.attr("GPU_DECODE_MAX_LOOP_STEPS") = GpuDecodeExecutor::kMaxLoopSteps;
#endif
}
