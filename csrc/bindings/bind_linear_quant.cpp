// kog._C.linear_quant: the linear layer over GGUF-quantized weight blocks (CPU kernels), and
// kog._C.quant_types: the block formats this build knows.
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "common/errors.h"
#include "cpu/kernels.h"
#include "ops/linear_quant.h"

namespace py = pybind11;

namespace {

void linear_quant(uintptr_t out, uintptr_t x, uintptr_t weight, int64_t weight_bytes, int64_t m, int64_t n,
                  int64_t k, int64_t x_stride, int64_t out_stride, int x_dtype, int type) {
  const kog::QuantType qt = static_cast<kog::QuantType>(type);
  const kog::QuantTypeInfo info = kog::quant_type_info(qt);
  KOG_CHECK(info.name != nullptr, "linear_quant: unsupported quant type ", type,
            " (supported: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
  KOG_CHECK(m >= 0 && n > 0 && k > 0, "linear_quant: bad shape m=", m, " n=", n, " k=", k);
  KOG_CHECK(k % info.elems == 0, "linear_quant: k=", k, " is not a multiple of the ", info.name, " block of ",
            info.elems, " elements");
  KOG_CHECK(x_dtype >= 0 && x_dtype <= 2, "linear_quant: x dtype code ", x_dtype, " is not a float type");
  const int64_t row_bytes = k / info.elems * info.bytes;
  KOG_CHECK(weight_bytes == n * row_bytes, "linear_quant: ", info.name, " weight of ", n, " rows of k=", k,
            " needs ", n * row_bytes, " bytes, got ", weight_bytes);
  KOG_CHECK(m <= 1 || (x_stride >= k && out_stride >= n), "linear_quant: row strides below the row length");
  KOG_CHECK(m == 0 || (out && x && weight), "linear_quant: null tensor");
  if (m == 0) return;
  std::vector<uint8_t> scratch(static_cast<size_t>(kog::linear_quant_scratch_bytes(m, k)));
  kog::LinearQuantParams p{reinterpret_cast<float*>(out), reinterpret_cast<const void*>(x),
                           reinterpret_cast<const uint8_t*>(weight), scratch.data(), m, n, k, x_stride,
                           out_stride, static_cast<kog::DType>(x_dtype), qt};
  kog::cpu::kernels().linear_quant(p);
}

// name -> (ggml type id, elements per block, bytes per block)
std::map<std::string, std::tuple<int, int, int>> quant_types() {
  std::map<std::string, std::tuple<int, int, int>> out;
  for (kog::QuantType t : kog::kQuantTypes) {
    const kog::QuantTypeInfo info = kog::quant_type_info(t);
    out[info.name] = {static_cast<int>(t), info.elems, info.bytes};
  }
  return out;
}

}  // namespace

void bind_linear_quant(py::module_& m) {
  using py::arg;
  m.def("linear_quant", &linear_quant, arg("out"), arg("x"), arg("weight"), arg("weight_bytes"), arg("m"),
        arg("n"), arg("k"), arg("x_stride"), arg("out_stride"), arg("x_dtype"), arg("quant_type"),
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_types", &quant_types);
}
