// kog._C.expand_gpu_program (every build: the GPU program expansion is tested on the CPU) and
// kog._C.GpuDecodeExecutor (the persistent decode kernel; raises BackendError in a CPU build).
// Raw device addresses in; kog/models/gpu_decode.py owns what they point to.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/errors.h"
#include "schedule/gpu_program.h"
#include "schedule/moe_route.h"
#ifdef KOG_WITH_GPU
#include "gpu/decode/executor.h"
#include "gpu/decode/peer_segment.h"
#endif

namespace py = pybind11;
using kog::schedule::ModelDims;
using kog::schedule::Op;

namespace {

#ifdef KOG_WITH_GPU
using kog::gpu::decode::GpuDecodeExecutor;

std::unique_ptr<GpuDecodeExecutor> make_executor(const ModelDims& dims, uintptr_t kv_base, int64_t num_blocks,
                                                 int64_t block_size, uintptr_t inv_freq, const std::vector<Op>& ops) {
  return std::make_unique<GpuDecodeExecutor>(
      dims, kog::schedule::KVCacheDesc{reinterpret_cast<void*>(kv_base), num_blocks, block_size, dims.dtype},
      reinterpret_cast<const float*>(inv_freq), kog::schedule::expand_gpu_program(ops, dims));
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
                                    ptr<const kog::schedule::SamplingRow>(sampling),
                                    rng_step,
                                    ptr<const int32_t>(stop_ids),
                                    n_stop_ids,
                                    ptr<int32_t>(out_tokens),
                                    ptr<int32_t>(finished),
                                    ptr<float>(logits)};
  ex.run(s, reinterpret_cast<void*>(stream));
}
#endif

// The GPU router tail's arrays for one batch's ROUTE expert ids (pairs row-major, `width` per
// row), computed with the kernel's own per-pair functions (moe_route.h), one pair at a time.
py::dict moe_group_pairs(const std::vector<int32_t>& expert, int32_t width) {
  KOG_CHECK(width > 0 && !expert.empty() && expert.size() % size_t(width) == 0, "moe_group_pairs: ", expert.size(),
            " experts are not rows of ", width);
  const auto P = int32_t(expert.size());
  std::vector<int32_t> first(expert.size()), rank(expert.size()), row_rank(expert.size()), group(expert.size());
  for (int32_t i = 0; i < P; ++i) first[size_t(i)] = kog::schedule::moe_is_first(expert.data(), i);
  for (int32_t i = 0; i < P; ++i) {
    rank[size_t(i)] = kog::schedule::moe_pair_rank(expert.data(), P, i);
    row_rank[size_t(i)] = kog::schedule::moe_row_rank(expert.data(), width, i);
    group[size_t(i)] = kog::schedule::moe_group_of(expert.data(), first.data(), P, i);
  }
  py::dict out;
  out["first"] = first, out["rank"] = rank, out["row_rank"] = row_rank, out["group"] = group;
  return out;
}

}  // namespace

void bind_gpu_decode(py::module_& m) {
  using py::arg;
  m.def(
      "expand_gpu_program",
      &kog::schedule::expand_gpu_program, arg("ops"), arg("dims"),
      "The program as the GPU persistent kernel runs it (ATTN_DECODE split into partial + combine, deps renumbered).");
  m.def(
      "lane_of_rows",
      [](const kog::schedule::ModelDims& d, const kog::schedule::Op& op) {
        KOG_CHECK(op.lanes > 1 && op.out >= 0, "lane_of_rows: op is not a lane LINEAR");
        const auto m = kog::schedule::LaneRows::of(d, op);
        std::vector<int64_t> lanes(size_t(kog::schedule::buffer_width(d, op.out)));
        for (size_t r = 0; r < lanes.size(); ++r) lanes[r] = m.lane_of(int64_t(r));
        return lanes;
      },
      arg("dims"), arg("op"), "The lane each output row of a lane LINEAR reads x from (schedule::LaneRows).");
  m.def(
      "comm_layout",
      [](const std::vector<Op>& ops, const ModelDims& dims, int64_t batch) {
        const auto l = kog::schedule::comm_layout(ops, dims, batch);
        py::dict out;
        out["offset"] = l.offset, out["part"] = l.part, out["parity_bytes"] = l.parity_bytes;
        return out;
      },
      arg("ops"), arg("dims"), arg("batch"),
      "Where each channel of an expanded rank program lives in a rank's inbox (schedule::comm_layout): "
      "{'offset': [channels], 'part': [channels], 'parity_bytes': int}.");
  m.def("program_sinks", &kog::schedule::program_sinks, arg("ops"),
        "Ops no later op depends on (a new GPU step waits on these).");
  m.attr("GPU_OP_LINEAR_SAMPLE_PARTIAL") = kog::schedule::kOpLinearSamplePartial;
  m.attr("GPU_OP_LINEAR_SILU_MUL") = kog::schedule::kOpLinearSiluMul;
  m.attr("GPU_OP_LINEAR_ROPE_KV") = kog::schedule::kOpLinearRopeKv;
  m.attr("GPU_OP_ROUTER_GEMV") = kog::schedule::kOpRouterGemv;
  m.attr("GPU_OP_MOE_GATE_UP") = kog::schedule::kOpMoeGateUp;
  m.attr("GPU_OP_MOE_DOWN") = kog::schedule::kOpMoeDown;
  m.attr("GPU_OP_MOE_COMBINE") = kog::schedule::kOpMoeCombine;
  m.attr("GPU_MOE_MAX_SLOTS") = kog::schedule::kMaxMoeSlots;
  m.attr("GPU_MOE_MAX_ROUTER_ROWS") = kog::schedule::kMaxRouterRows;
  m.def("moe_group_pairs", &moe_group_pairs, arg("expert"), arg("width"),
        "The GPU router tail's per-pair values (moe_route.h) for ROUTE's expert ids: first, rank (sorted "
        "position), row_rank (order within the row), group.");
#ifdef KOG_WITH_GPU
  py::class_<GpuDecodeExecutor>(m, "GpuDecodeExecutor")
      .def(py::init(&make_executor), arg("dims"), arg("kv_base"), arg("num_blocks"), arg("block_size"),
           arg("inv_freq"), arg("ops"))
      .def("run", &run, arg("batch"), arg("n_steps"), arg("tokens"), arg("positions"), arg("seq_lens"), arg("slots"),
           arg("block_tables"), arg("max_blocks"), arg("max_seq_len"), arg("sampling"), arg("rng_step"),
           arg("stop_ids"), arg("n_stop_ids"), arg("out_tokens"), arg("finished"), arg("logits"), arg("stream"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_wait_timeout_ms", &GpuDecodeExecutor::set_wait_timeout_ms, arg("ms"),
           "Bound of the kernel's dependency waits (0: none); a longer wait traps (see wait_timeout)")
      .def("wait_timeout",
           [](const GpuDecodeExecutor& ex) -> py::object {
             const kog::gpu::decode::WaitTimeout t = ex.wait_timeout();
             if (!t.fired) return py::none();
             py::dict d;
             d["block"] = t.block, d["step"] = t.step, d["op"] = t.op, d["count"] = t.count, d["target"] = t.target;
             return d;
           },
           "What the first timed-out wait recorded ({block, step, op, count, target}), or None")
      .def("set_debug_skip_signal_op", &GpuDecodeExecutor::set_debug_skip_signal_op, arg("op"),
           "Tests: op (expanded index) of step 0 whose items never signal; -1 off")
      .def_property_readonly("grid_size", &GpuDecodeExecutor::grid_size)
      .def_property_readonly("num_ops", &GpuDecodeExecutor::num_ops)
      .def_property_readonly("inbox_bytes", &GpuDecodeExecutor::inbox_bytes,
                             "A tensor-parallel rank's inbox size (0 on one rank)")
      .def_property_readonly("flag_count", &GpuDecodeExecutor::flag_count,
                             "A tensor-parallel rank's uint64 flags (0 on one rank)")
      .def("set_ranks", &GpuDecodeExecutor::set_ranks, arg("inboxes"), arg("flags"),
           "Every rank's inbox and flags (device addresses as this process maps them, rank order)")
      .def("set_max_grid", &GpuDecodeExecutor::set_max_grid, arg("max_grid"),
           "At most this many workgroups per launch (0: as many as fit)");
  py::class_<kog::gpu::decode::PeerSegment>(m, "PeerSegment",
                                            "A tensor-parallel rank's inbox and flags, shared with the other ranks' "
                                            "processes through IPC handles (gpu/decode/peer_segment.h).")
      .def(py::init<int64_t, int64_t>(), arg("inbox_bytes"), arg("flag_count"))
      .def("handle", [](const kog::gpu::decode::PeerSegment& s) { return py::bytes(s.handle()); },
           "This rank's IPC handles, for every other rank's open()")
      .def(
          "open",
          [](kog::gpu::decode::PeerSegment& s, const std::vector<py::bytes>& handles, int rank) {
            std::vector<std::string> h(handles.begin(), handles.end());
            s.open(h, rank);
          },
          arg("handles"), arg("rank"), "Maps every other rank's segment (handles in rank order, this one's included)")
      .def_property_readonly("inboxes", &kog::gpu::decode::PeerSegment::inboxes)
      .def_property_readonly("flags", &kog::gpu::decode::PeerSegment::flags);
  m.attr("GPU_DECODE_MAX_BATCH") = GpuDecodeExecutor::kMaxBatch;
  m.attr("GPU_DECODE_MAX_LOOP_STEPS") = GpuDecodeExecutor::kMaxLoopSteps;
#endif
}
