// PYBIND11_MODULE(_C): one bind_* function per area, nothing else.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_errors(py::module_& m);
void bind_info(py::module_& m);
void bind_thread_pool(py::module_& m);
void bind_kvcache(py::module_& m);
void bind_ops(py::module_& m);
void bind_linear(py::module_& m);
void bind_linear_quant(py::module_& m);
void bind_schedule(py::module_& m);
void bind_attention(py::module_& m);
void bind_engine(py::module_& m);
void bind_decode_loop(py::module_& m);
void bind_gpu_decode(py::module_& m);
void bind_transport(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "Kog native core: CPU/GPU kernels and the paged KV allocator";
  bind_errors(m);
  bind_info(m);
  bind_thread_pool(m);
  bind_kvcache(m);
  bind_ops(m);
  bind_linear(m);
  bind_linear_quant(m);
  bind_schedule(m);
  bind_attention(m);
  bind_engine(m);
  bind_decode_loop(m);
  bind_gpu_decode(m);
  bind_transport(m);
}
