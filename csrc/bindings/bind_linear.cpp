// kog._C.linear: the decode-batch linear layer (CPU; the GPU GEMV comes with the GPU issue).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "common/errors.h"
#include "cpu/kernels.h"

namespace py = pybind11;

namespace {

void linear(uintptr_t out, uintptr_t x, uintptr_t weight, uintptr_t bias, int64_t m, int64_t n,
            int64_t k, int64_t x_stride, int64_t out_stride, int dtype, int64_t device) {
  KOG_CHECK(m >= 0 && n > 0 && k > 0, "linear: bad shape m=", m, " n=", n, " k=", k);
  KOG_CHECK(dtype >= 0 && dtype <= 2, "linear: dtype code ", dtype, " is not a float type");
  KOG_CHECK(m == 0 || (out && x && weight), "linear: null tensor");
  KOG_CHECK_KIND(device < 0, kBackend, "linear: no GPU kernel in this build yet");
  if (m == 0) return;
  kog::LinearParams p{reinterpret_cast<void*>(out), reinterpret_cast<const void*>(x),
                      reinterpret_cast<const void*>(weight), reinterpret_cast<const void*>(bias),
                      m, n, k, x_stride, out_stride, static_cast<kog::DType>(dtype)};
  std::vector<float> scratch(static_cast<size_t>(m * k));
  kog::cpu::kernels().linear(p, scratch.data());
}

}  // namespace

void bind_linear(py::module_& m) {
  using py::arg;
  m.def("linear", &linear, arg("out"), arg("x"), arg("weight"), arg("bias"), arg("m"), arg("n"),
        arg("k"), arg("x_stride"), arg("out_stride"), arg("dtype"), arg("device"),
        py::call_guard<py::gil_scoped_release>());
}
