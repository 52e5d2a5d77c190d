// kog._C.SequenceSampling, sample_sequences, sample_row, uniform01 and DecodeLoop: the native
// sampler and the CPU multi-token decode loop (csrc/engine/decode_loop.h). Raw addresses in
// for the per-step arrays, GIL released while native work runs. kog/engine/decode_loop.py
// builds them from SamplingParams and the engine's sequences.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "common/errors.h"
#include "cpu/kernels.h"
#include "engine/decode_loop.h"
#include "ops/sample_chunks.h"

namespace py = pybind11;
using kog::engine::DecodeExecutor;
using kog::engine::DecodeLoop;
using kog::engine::SamplingConfig;
using kog::engine::SequenceSampling;

namespace {

using IdArray = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

std::vector<SequenceSampling*> row_pointers(const std::vector<SequenceSampling*>& rows, int64_t batch) {
  KOG_CHECK(int64_t(rows.size()) == batch, "expected ", batch, " sampling rows, got ", rows.size());
  return rows;
}

SequenceSampling* make_sampling(int64_t vocab, IdArray prompt, float temperature, int32_t top_k, float top_p,
                                float min_p, uint64_t seed, float repetition_penalty, float presence_penalty,
                                float frequency_penalty, int64_t min_tokens, int64_t max_output,
                                std::vector<int32_t> stop_ids, std::vector<int32_t> banned_ids) {
  SamplingConfig c;
  c.temperature = temperature, c.top_k = top_k, c.top_p = top_p, c.min_p = min_p, c.seed = seed;
  c.repetition_penalty = repetition_penalty, c.presence_penalty = presence_penalty;
  c.frequency_penalty = frequency_penalty, c.min_tokens = min_tokens, c.max_output = max_output;
  c.stop_ids = std::move(stop_ids), c.banned_ids = std::move(banned_ids);
  return new SequenceSampling(std::move(c), vocab, prompt.data(), prompt.size());
}

// The kernel on one row with explicit filter parameters (tests compare it with a reference).
int32_t sample_row(py::array_t<float, py::array::c_style | py::array::forcecast> logits, float temperature,
                   int32_t top_k, float top_p, float min_p, uint64_t seed, uint64_t counter) {
  KOG_CHECK(logits.ndim() == 1 && logits.size() > 0, "sample_row: logits must be a non-empty [vocab] array");
  std::vector<float> x(logits.data(), logits.data() + logits.size()), scratch(x.size());
  kog::SampleRowParams r{};
  r.temperature = temperature, r.top_k = top_k, r.top_p = top_p, r.min_p = min_p, r.seed = seed;
  r.counter = counter, r.repetition_penalty = 1.f;
  int32_t token = -1;
  kog::cpu::kernels().sample({x.data(), 1, int64_t(x.size()), &r, &token, scratch.data()});
  return token;
}

// The GPU's chunked sampler (ops/sample_chunks.h) on the host: chunk summaries, then the draw
// from them; kog::kSampleFallback where the summaries do not decide.
int32_t sample_row_chunked(py::array_t<float, py::array::c_style | py::array::forcecast> logits, float temperature,
                           int32_t top_k, float top_p, float min_p, uint64_t seed, uint64_t counter) {
  KOG_CHECK(logits.ndim() == 1 && logits.size() > 0 && logits.size() < INT32_MAX,
            "sample_row_chunked: logits must be a non-empty [vocab] array");
  const int64_t vocab = logits.size(), n_chunks = kog::sample_chunks(vocab);
  std::vector<kog::SampleChunk> chunks(size_t(n_chunks), kog::SampleChunk{});
  std::vector<float> values(size_t(n_chunks) * kog::kSampleCandidateSlots);
  std::vector<int32_t> indices(values.size());
  for (int64_t c = 0; c < n_chunks; ++c)
    chunks[size_t(c)] = kog::summarize_chunk(logits.data(), vocab, c, temperature, &values[size_t(c) * kog::kSampleCandidateSlots],
                                             &indices[size_t(c) * kog::kSampleCandidateSlots]);
  return kog::sample_from_chunks(kog::SerialTeam{}, chunks.data(), int(n_chunks), values.data(), indices.data(),
                                 logits.data(), vocab, temperature, top_k, top_p, min_p, seed, counter);
}

}  // namespace

void bind_decode_loop(py::module_& m) {
  using py::arg;
  m.def("uniform01", [](uint64_t seed, uint64_t counter) { return kog::uniform01(seed, counter); }, arg("seed"),
        arg("counter"), "The sampler's draw in [0, 1): a function of (seed, counter) only, as on the GPU.");
  m.def("sample_row", &sample_row, arg("logits"), arg("temperature"), arg("top_k"), arg("top_p"), arg("min_p"),
        arg("seed"), arg("counter"));
  m.def("sample_row_chunked", &sample_row_chunked, arg("logits"), arg("temperature"), arg("top_k"), arg("top_p"),
        arg("min_p"), arg("seed"), arg("counter"),
        "The decode kernel's chunked sampler on the host: the token, or SAMPLE_FALLBACK where the chunk summaries do "
        "not decide (the kernel then runs the full-row sampler).");
  m.attr("SAMPLE_FALLBACK") = kog::kSampleFallback;
  m.attr("SAMPLE_CHUNK") = kog::kSampleChunk;
  m.attr("SAMPLE_CANDIDATES") = kog::kSampleCandidates;

  py::class_<SequenceSampling>(m, "SequenceSampling")
      .def(py::init(&make_sampling), arg("vocab"), arg("prompt"), arg("temperature"), arg("top_k"), arg("top_p"),
           arg("min_p"), arg("seed"), arg("repetition_penalty"), arg("presence_penalty"), arg("frequency_penalty"),
           arg("min_tokens"), arg("max_output"), arg("stop_ids"), arg("banned_ids"))
      .def("add_output", &SequenceSampling::add_output, arg("token"))
      .def("add_outputs",
           [](SequenceSampling& s, IdArray ids) {
             for (py::ssize_t i = 0; i < ids.size(); ++i) s.add_output(ids.data()[i]);
           },
           arg("tokens"))
      .def("finish_after", [](const SequenceSampling& s, int32_t t) { return int(s.finish_after(t)); }, arg("token"))
      .def_property_readonly("n_output", &SequenceSampling::n_output)
      .def_property_readonly("seed", [](const SequenceSampling& s) { return s.config().seed; });

  m.def(
      "sample_sequences",
      [](uintptr_t logits, int64_t batch, int64_t vocab, const std::vector<SequenceSampling*>& rows,
         uintptr_t tokens) {
        const auto ptrs = row_pointers(rows, batch);
        py::gil_scoped_release release;
        kog::engine::sample_sequences(reinterpret_cast<float*>(logits), batch, vocab, ptrs.data(),
                                      reinterpret_cast<int32_t*>(tokens));
      },
      arg("logits"), arg("batch"), arg("vocab"), arg("rows"), arg("tokens"),
      "One token per row of f32 logits [batch, vocab] (penalties applied in place) into int32 tokens [batch].");

  py::class_<DecodeLoop>(m, "DecodeLoop")
      .def(py::init<DecodeExecutor&, int64_t, int64_t>(), arg("executor"), arg("vocab"), arg("block_size"),
           py::keep_alive<1, 2>())
      .def(
          "run",
          [](DecodeLoop& loop, int64_t batch, int64_t n_steps, uintptr_t tokens, uintptr_t positions,
             uintptr_t block_tables, int64_t max_blocks, const std::vector<SequenceSampling*>& rows,
             uintptr_t out_tokens, uintptr_t n_new, uintptr_t finish) {
            const auto ptrs = row_pointers(rows, batch);
            py::gil_scoped_release release;
            loop.run({batch, n_steps, reinterpret_cast<const int64_t*>(tokens),
                      reinterpret_cast<const int64_t*>(positions), reinterpret_cast<const int32_t*>(block_tables),
                      max_blocks, ptrs.data(), reinterpret_cast<int64_t*>(out_tokens),
                      reinterpret_cast<int32_t*>(n_new), reinterpret_cast<int32_t*>(finish)});
          },
          arg("batch"), arg("n_steps"), arg("tokens"), arg("positions"), arg("block_tables"), arg("max_blocks"),
          arg("rows"), arg("out_tokens"), arg("n_new"), arg("finish"));
}
