// kog._C.linear: the decode-batch linear layer (CPU kernels, or the GPU GEMV when device >= 0).
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <atomic>
#include <mutex>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "cpu/kernels.h"
#include "cpu/row_queue.h"
#include "gpu/launch.h"

namespace py = pybind11;

namespace {

void linear(uintptr_t out, uintptr_t x, uintptr_t weight, uintptr_t bias, int64_t m, int64_t n,
            int64_t k, int64_t x_stride, int64_t out_stride, int dtype, int64_t device, uintptr_t stream) {
  KOG_CHECK(m >= 0 && n > 0 && k > 0, "linear: bad shape m=", m, " n=", n, " k=", k);
  KOG_CHECK(dtype >= 0 && dtype <= 2, "linear: dtype code ", dtype, " is not a float type");
  KOG_CHECK(m == 0 || (out && x && weight), "linear: null tensor");
  if (m == 0) return;
  kog::LinearParams p{reinterpret_cast<void*>(out), reinterpret_cast<const void*>(x),
                      reinterpret_cast<const void*>(weight), reinterpret_cast<const void*>(bias),
                      m, n, k, x_stride, out_stride, static_cast<kog::DType>(dtype)};
  if (device >= 0) {
#ifdef KOG_WITH_GPU
    kog::gpu::linear(p, reinterpret_cast<void*>(stream));
    return;
#else
    kog::throw_error(kog::ErrorKind::kBackend, "linear: this kog build has no GPU backend");
#endif
  }
  std::vector<float> scratch(static_cast<size_t>(m * k));
  kog::cpu::kernels().linear(p, scratch.data());
}

// The GPU GEMV over FP8 e4m3 weights (uint8 [n, k] in the build's encoding, scale [n] f32).
void linear_fp8(uintptr_t out, uintptr_t x, uintptr_t weight, uintptr_t scale, uintptr_t bias, int64_t m, int64_t n,
                int64_t k, int64_t x_stride, int64_t out_stride, int dtype, uintptr_t stream) {
  KOG_CHECK(m >= 0 && n > 0 && k > 0, "linear_fp8: bad shape m=", m, " n=", n, " k=", k);
  KOG_CHECK(dtype >= 0 && dtype <= 2, "linear_fp8: dtype code ", dtype, " is not a float type");
  KOG_CHECK(m == 0 || (out && x && weight && scale), "linear_fp8: null tensor");
  if (m == 0) return;
#ifdef KOG_WITH_GPU
  kog::LinearParams p{reinterpret_cast<void*>(out), reinterpret_cast<const void*>(x),
                      reinterpret_cast<const void*>(weight), reinterpret_cast<const void*>(bias),
                      m, n, k, x_stride, out_stride, static_cast<kog::DType>(dtype)};
  kog::gpu::linear_fp8(p, reinterpret_cast<const float*>(scale), reinterpret_cast<void*>(stream));
#else
  (void)out_stride, (void)x_stride, (void)bias, (void)stream;
  kog::throw_error(kog::ErrorKind::kBackend, "linear_fp8: this kog build has no GPU backend (the CPU runs FP8 "
                   "models dequantized)");
#endif
}

// The GPU GEMV over 4-bit weights (uint8 [n, k / 2] codes, groups the format's scales; w_type
// WEIGHT_Q4_GROUPS or WEIGHT_Q4_K: kog.int4).
void linear_q4(uintptr_t out, uintptr_t x, uintptr_t weight, uintptr_t groups, int32_t w_type, uintptr_t bias,
               int64_t m, int64_t n, int64_t k, int64_t x_stride, int64_t out_stride, int dtype, uintptr_t stream) {
  KOG_CHECK(m >= 0 && n > 0 && k > 0, "linear_q4: bad shape m=", m, " n=", n, " k=", k);
  KOG_CHECK(dtype >= 0 && dtype <= 2, "linear_q4: dtype code ", dtype, " is not a float type");
  KOG_CHECK(m == 0 || (out && x && weight && groups), "linear_q4: null tensor");
  if (m == 0) return;
#ifdef KOG_WITH_GPU
  kog::LinearParams p{reinterpret_cast<void*>(out), reinterpret_cast<const void*>(x),
                      reinterpret_cast<const void*>(weight), reinterpret_cast<const void*>(bias),
                      m, n, k, x_stride, out_stride, static_cast<kog::DType>(dtype)};
  kog::gpu::linear_q4(p, reinterpret_cast<const void*>(groups), w_type, reinterpret_cast<void*>(stream));
#else
  (void)out_stride, (void)x_stride, (void)bias, (void)stream, (void)w_type;
  kog::throw_error(kog::ErrorKind::kBackend, "linear_q4: this kog build has no GPU backend (the CPU runs GGUF "
                   "blocks with its own kernels)");
#endif
}

// Test hook for cpu::RowQueue: n_threads threads split n_chunks chunks for each of n_epochs
// epochs (a barrier between epochs, as in the executor). Thread `slow` (if >= 0), after its
// first chunk of an epoch, holds until the others have taken more chunks than their own slices
// hold, i.e. stolen from it (or 10 s passed); the others start only once it holds. So stealing
// is forced whatever the OS scheduling.
// Returns, per epoch, the thread that took each chunk (-1: nobody) and how many times each
// chunk was taken.
std::pair<std::vector<std::vector<int>>, std::vector<std::vector<int>>> row_queue_claims(
    int n_threads, int64_t n_chunks, int n_epochs, int slow) {
  KOG_CHECK(n_threads >= 1 && n_chunks >= 0 && n_epochs >= 1 && slow < n_threads, "row_queue_claims: bad arguments");
  kog::cpu::RowQueue q(n_threads);
  std::vector<std::vector<int>> owner(size_t(n_epochs), std::vector<int>(size_t(n_chunks), -1));
  std::vector<std::vector<int>> count(size_t(n_epochs), std::vector<int>(size_t(n_chunks), 0));
  std::vector<std::atomic<int64_t>> by_others(static_cast<size_t>(n_epochs));
  std::vector<std::atomic<bool>> holding(static_cast<size_t>(n_epochs));
  const int64_t others_own = n_chunks - (n_chunks * (slow + 1) / n_threads - n_chunks * slow / n_threads);
  // Plain threads, not the worker pool: the test needs exactly n_threads of them.
  std::atomic<int> arrived{0};
  auto epoch_barrier = [&](int e) {  // the e-th barrier: every thread has finished epoch e
    arrived.fetch_add(1);
    while (arrived.load() < (e + 1) * n_threads) std::this_thread::yield();
  };
  std::mutex count_mu;
  auto body = [&](int t) {
      for (int e = 0; e < n_epochs; ++e) {
        q.start(uint32_t(e), t, n_chunks);
        if (slow >= 0 && t != slow && n_chunks > 0)
          while (!holding[size_t(e)].load()) std::this_thread::yield();
        bool first = true;
        for (int64_t c; (c = q.next(uint32_t(e), t)) >= 0;) {
          {
            std::lock_guard<std::mutex> lock(count_mu);
            count[size_t(e)][size_t(c)] += 1;
          }
          owner[size_t(e)][size_t(c)] = t;
          if (t != slow) by_others[size_t(e)].fetch_add(1);
          if (t == slow && first) {
            holding[size_t(e)].store(true);
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
            while (by_others[size_t(e)].load() <= others_own && std::chrono::steady_clock::now() < deadline)
              std::this_thread::yield();
          }
          first = false;
        }
        epoch_barrier(e);
      }
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < n_threads; ++t) threads.emplace_back(body, t);
  body(0);
  for (auto& th : threads) th.join();
  return {owner, count};
}

}  // namespace

void bind_linear(py::module_& m) {
  using py::arg;
  m.def("linear", &linear, arg("out"), arg("x"), arg("weight"), arg("bias"), arg("m"), arg("n"),
        arg("k"), arg("x_stride"), arg("out_stride"), arg("dtype"), arg("device"), arg("stream") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_fp8", &linear_fp8, arg("out"), arg("x"), arg("weight"), arg("scale"), arg("bias"), arg("m"),
        arg("n"), arg("k"), arg("x_stride"), arg("out_stride"), arg("dtype"), arg("stream") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_q4", &linear_q4, arg("out"), arg("x"), arg("weight"), arg("groups"), arg("w_type"), arg("bias"),
        arg("m"), arg("n"), arg("k"), arg("x_stride"), arg("out_stride"), arg("dtype"), arg("stream") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("_row_queue_claims", &row_queue_claims, arg("n_threads"), arg("n_chunks"), arg("n_epochs"),
        arg("slow") = -1, py::call_guard<py::gil_scoped_release>());
  m.def(
      "sample_gpu",
      [](uintptr_t logits, int64_t n_rows, int64_t vocab, uintptr_t rows, uint64_t counter, uintptr_t out,
         uintptr_t stream) {
#ifdef KOG_WITH_GPU
        kog::gpu::sample(reinterpret_cast<const float*>(logits), n_rows, vocab, reinterpret_cast<const void*>(rows),
                         counter, reinterpret_cast<int32_t*>(out), reinterpret_cast<void*>(stream));
#else
        kog::throw_error(kog::ErrorKind::kBackend, "sample_gpu: this kog build has no GPU backend");
#endif
      },
      arg("logits"), arg("n_rows"), arg("vocab"), arg("rows"), arg("counter"), arg("out"), arg("stream"),
      py::call_guard<py::gil_scoped_release>());
}
