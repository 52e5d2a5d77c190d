// Build and runtime report: kog.backend_info() is built from these.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <string>

#include "cpu/kernels.h"
#include "gpu/launch.h"

namespace py = pybind11;

namespace {

py::list gpu_devices() {
  py::list out;
#ifdef KOG_WITH_GPU
  for (const auto& d : kog::gpu::devices()) {
    py::dict e;
    e["index"] = d.index;
    e["name"] = d.name;
    e["arch"] = d.arch;
    e["total_memory"] = d.total_memory;
    e["multiprocessors"] = d.multiprocessors;
    e["warp_size"] = d.warp_size;
    e["shared_memory_per_block"] = d.shared_memory_per_block;
    out.append(e);
  }
#endif
  return out;
}

py::dict build_info() {
  py::dict d;
  d["backend"] = KOG_BACKEND_NAME;
  d["gpu_archs"] = KOG_GPU_ARCHS_STR;
  d["compiler"] = KOG_COMPILER_STR;
#ifdef KOG_WITH_GPU
  d["gpu_runtime"] = kog::gpu::runtime_version();
#else
  d["gpu_runtime"] = py::none();
#endif
  d["cpu_isa"] = kog::cpu::kernels().isa;
  d["cpu_isas_supported"] = kog::cpu::supported_isas();
  d["cpu_threads"] = kog::cpu::num_threads();
  d["cpu_prefetch"] = kog::cpu::weight_prefetch_name(kog::cpu::weight_prefetch());
  d["cpu_bf16_gemm"] = kog::cpu::bf16_gemm_unit();
  return d;
}

}  // namespace

void bind_info(py::module_& m) {
  // KOG_CPU_PREFETCH is read here, on the importing thread: a bad value fails the import with
  // its message, never later inside a kernel's worker thread.
  (void)kog::cpu::weight_prefetch();
  m.def("build_info", &build_info, "backend, GPU targets, compiler and CPU ISA of this build");
  m.def("gpu_devices", &gpu_devices, "GPUs visible to this build's runtime (empty on CPU builds)");
  m.def("set_cpu_isa", &kog::cpu::set_isa, py::arg("isa"),
        "use the CPU kernels built for `isa` (generic, avx2, avx512)");
  m.def("cpu_isas_supported", &kog::cpu::supported_isas);
  m.def(
      "set_cpu_prefetch",
      [](const std::string& name) {
        kog::cpu::set_weight_prefetch(kog::cpu::weight_prefetch_named(name, "cpu prefetch '" + name + "'"));
      },
      py::arg("policy"), "how the bf16 GEMV prefetches weights: none, t0 or nta (KOG_CPU_PREFETCH)");
  m.def("cpu_bf16_gemm", [] { return std::string(kog::cpu::bf16_gemm_unit()); },
        "the CPU's native bf16 matrix instructions: amx_bf16, avx512_bf16, or '' (none)");
  m.def("cpu_prefetch", [] { return std::string(kog::cpu::weight_prefetch_name(kog::cpu::weight_prefetch())); },
        "the bf16 GEMV's weight prefetch policy in use");
  m.attr("has_gpu_backend") =
#ifdef KOG_WITH_GPU
      true;
#else
      false;
#endif
}
