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
#include "schedule/program.h"

namespace py = pybind11;

namespace {

void linear_quant(uintptr_t out, uintptr_t x, uintptr_t weight, int64_t weight_bytes, int64_t m, int64_t n,
                  int64_t k, int64_t x_stride, int64_t out_stride, int x_dtype, int type, int x_stages) {
  const kog::QuantType qt = static_cast<kog::QuantType>(type);
  const kog::QuantTypeInfo info = kog::quant_type_info(qt);
  KOG_CHECK(info.name != nullptr, "linear_quant: unsupported quant type ", type, " (supported: ",
            kog::schedule::quant_type_list(), ")");
  KOG_CHECK(!kog::is_packed(qt) || n % kog::kPackRows == 0, "linear_quant: a ", info.name, " weight has ",
            kog::kPackRows, "-row groups, got n=", n);
  KOG_CHECK(m >= 0 && n > 0 && k > 0, "linear_quant: bad shape m=", m, " n=", n, " k=", k);
  KOG_CHECK(k % info.elems == 0, "linear_quant: k=", k, " is not a multiple of the ", info.name, " block of ",
            info.elems, " elements");
  KOG_CHECK(x_dtype >= 0 && x_dtype <= 2, "linear_quant: x dtype code ", x_dtype, " is not a float type");
  const int64_t row_bytes = k / info.elems * info.bytes;
  KOG_CHECK(weight_bytes == n * row_bytes, "linear_quant: ", info.name, " weight of ", n, " rows of k=", k,
            " needs ", n * row_bytes, " bytes, got ", weight_bytes);
  KOG_CHECK(m <= 1 || (x_stride >= k && out_stride >= n), "linear_quant: row strides below the row length");
  KOG_CHECK(m == 0 || (out && x && weight), "linear_quant: null tensor");
  KOG_CHECK(x_stages >= 0 && x_stages <= 2, "linear_quant: x_stages must be 0, 1 or 2, got ", x_stages);
  KOG_CHECK(x_stages != 0 || x_dtype == static_cast<int>(kog::DType::kF32),
            "linear_quant: x_stages 0 (f32 x) needs a float32 x");
  if (m == 0) return;
  std::vector<uint8_t> scratch(static_cast<size_t>(kog::linear_quant_scratch_bytes(m, k, x_stages)));
  kog::LinearQuantParams p{reinterpret_cast<float*>(out), reinterpret_cast<const void*>(x),
                           reinterpret_cast<const uint8_t*>(weight), scratch.data(), m, n, k, x_stride,
                           out_stride, static_cast<kog::DType>(x_dtype), qt};
  p.x_stages = x_stages;
  kog::cpu::kernels().linear_quant(p);
}

// out [n_ids, k] f32 <- rows ids (or rows 0..n_ids-1 when ids is 0) of weight [rows, row_bytes].
void dequantize_rows(uintptr_t out, uintptr_t weight, int64_t weight_bytes, int64_t rows, uintptr_t ids,
                     int64_t n_ids, int64_t k, int type) {
  const kog::QuantType qt = static_cast<kog::QuantType>(type);
  const kog::QuantTypeInfo info = kog::quant_type_info(qt);
  KOG_CHECK(info.name != nullptr, "dequantize_rows: unsupported quant type ", type);
  KOG_CHECK(!kog::is_packed(qt) || rows % kog::kPackRows == 0, "dequantize_rows: a ", info.name,
            " weight has ", kog::kPackRows, "-row groups, got ", rows, " rows");
  KOG_CHECK(k > 0 && k % info.elems == 0 && rows >= 0 && n_ids >= 0, "dequantize_rows: bad shape k=", k,
            " rows=", rows, " n_ids=", n_ids, " for ", info.name);
  KOG_CHECK(weight_bytes == rows * (k / info.elems * info.bytes), "dequantize_rows: ", rows, " rows of ",
            info.name, " k=", k, " need ", rows * (k / info.elems * info.bytes), " bytes, got ", weight_bytes);
  const int64_t* id = reinterpret_cast<const int64_t*>(ids);
  KOG_CHECK(id != nullptr || n_ids <= rows, "dequantize_rows: ", n_ids, " rows asked of ", rows);
  for (int64_t i = 0; id != nullptr && i < n_ids; ++i)
    KOG_CHECK(id[i] >= 0 && id[i] < rows, "dequantize_rows: row id ", id[i], " outside [0, ", rows, ")");
  if (n_ids == 0) return;
  kog::DequantizeRowsParams p{reinterpret_cast<float*>(out), reinterpret_cast<const uint8_t*>(weight), id, n_ids,
                              k, qt};
  kog::cpu::kernels().dequantize_rows(p);
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

// name -> (Kog's type id, the file type it packs, rows per group, fp16 fields leading / ending a
// block): the row-interleaved forms and their layout (kog::pack_layout).
std::map<std::string, std::tuple<int, int, int, int, int>> packed_quant_types() {
  std::map<std::string, std::tuple<int, int, int, int, int>> out;
  for (kog::QuantType t : kog::kPackedQuantTypes) {
    const kog::PackLayout lay = kog::pack_layout(t);
    out[kog::quant_type_info(t).name] = {static_cast<int>(t), static_cast<int>(kog::packed_base(t)),
                                         kog::kPackRows, lay.front, lay.back};
  }
  return out;
}

}  // namespace

void bind_linear_quant(py::module_& m) {
  using py::arg;
  m.def("linear_quant", &linear_quant, arg("out"), arg("x"), arg("weight"), arg("weight_bytes"), arg("m"),
        arg("n"), arg("k"), arg("x_stride"), arg("out_stride"), arg("x_dtype"), arg("quant_type"),
        arg("x_stages") = 1, py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, arg("out"), arg("weight"), arg("weight_bytes"), arg("rows"),
        arg("ids"), arg("n_ids"), arg("k"), arg("quant_type"), py::call_guard<py::gil_scoped_release>());
  m.def("quant_types", &quant_types);
  m.def("packed_quant_types", &packed_quant_types);
}
