// Kog's CPU worker pool: its size, and test hooks for its waits and barriers.
#include <pybind11/pybind11.h>

#include <time.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <tuple>
#include <vector>

#include "common/errors.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"

namespace py = pybind11;
using kog::cpu::ThreadPool;

namespace {

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// n_phases rounds of: every thread writes its mark, a barrier, every thread checks that every
// mark reached this round, a barrier. Returns (threads of the region, violations seen).
std::tuple<int, int64_t> barrier_check(int n_threads, int n_phases) {
  ThreadPool& pool = ThreadPool::instance();
  std::vector<std::atomic<int>> marks(size_t(std::max(1, n_threads)));
  std::atomic<int64_t> violations{0};
  std::atomic<int> team{0};
  pool.run(n_threads, [&](int t, int nt) {
    if (t == 0) team.store(nt);
    for (int k = 1; k <= n_phases; ++k) {
      marks[size_t(t)].store(k, std::memory_order_relaxed);
      pool.barrier();
      for (int u = 0; u < nt; ++u)
        if (marks[size_t(u)].load(std::memory_order_relaxed) != k) violations.fetch_add(1);
      pool.barrier();
    }
  });
  return {team.load(), violations.load()};
}

// CPU seconds this process spent (a) during one region in which thread 0 sleeps hold_ms while
// the others wait at a barrier, (b) while the caller sleeps hold_ms after a region (the
// workers parked). Spinning waiters would cost about (threads - 1) x hold_ms in each.
std::tuple<int, double, double> wait_cpu(int n_threads, int hold_ms) {
  ThreadPool& pool = ThreadPool::instance();
  std::atomic<int> team{0};
  const auto hold = std::chrono::milliseconds(hold_ms);
  const double c0 = process_cpu_seconds();
  pool.run(n_threads, [&](int t, int nt) {
    if (t == 0) {
      team.store(nt);
      std::this_thread::sleep_for(hold);
    }
    pool.barrier();
  });
  const double c1 = process_cpu_seconds();
  std::this_thread::sleep_for(hold);
  const double c2 = process_cpu_seconds();
  return {team.load(), c1 - c0, c2 - c1};
}

// A region in which thread `thrower` raises a KogError; with nested = true, every thread first
// runs a region of its own (which must run inline, on that thread alone).
int64_t throw_check(int n_threads, int thrower, bool nested) {
  ThreadPool& pool = ThreadPool::instance();
  std::atomic<int64_t> inline_ok{0};
  pool.run(n_threads, [&](int t, int) {
    if (nested)
      pool.run(n_threads, [&](int tt, int nt) {
        if (tt == 0 && nt == 1) inline_ok.fetch_add(1);
      });
    KOG_CHECK(t != thrower, "thread ", t, " of the region failed on purpose");
  });
  return inline_ok.load();
}

// A region of n_threads in which thread nt - 1 sleeps sleep_us before each of n_phases barriers
// (a thread another process keeps off its core). Returns the threads of the region.
int slow_barriers(int n_threads, int n_phases, int sleep_us) {
  ThreadPool& pool = ThreadPool::instance();
  std::atomic<int> team{0};
  pool.run(n_threads, [&](int t, int nt) {
    if (t == 0) team.store(nt);
    for (int k = 0; k < n_phases; ++k) {
      if (t == nt - 1 && nt > 1) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      pool.barrier();
    }
  });
  return team.load();
}

}  // namespace

void bind_thread_pool(py::module_& m) {
  using py::arg;
  m.def("cpu_num_threads", &kog::cpu::num_threads,
        "threads of Kog's CPU worker pool (KOG_NUM_THREADS, else OMP_NUM_THREADS, else the CPUs this "
        "process may run on)");
  m.def(
      "set_cpu_num_threads",
      [](int n) {
        KOG_CHECK(n >= 1, "set_cpu_num_threads: n must be >= 1, got ", n);
        ThreadPool::instance().set_size(n);
      },
      arg("n"), "threads of Kog's CPU worker pool, from the next parallel region on");
  m.def("_thread_pool_barrier_check", &barrier_check, arg("n_threads"), arg("n_phases"),
        py::call_guard<py::gil_scoped_release>());
  m.def("_thread_pool_wait_cpu", &wait_cpu, arg("n_threads"), arg("hold_ms"),
        py::call_guard<py::gil_scoped_release>());
  m.def("_thread_pool_slow_barriers", &slow_barriers, arg("n_threads"), arg("n_phases"), arg("sleep_us"),
        py::call_guard<py::gil_scoped_release>());
  m.def("_thread_pool_contention", [] {
    ThreadPool& pool = ThreadPool::instance();
    return std::make_tuple(pool.backoffs(), pool.backing_off());
  }, "(back-offs so far, backing off now)");
  m.def("_thread_pool_reset_contention", [] { ThreadPool::instance().reset_contention(); },
        py::call_guard<py::gil_scoped_release>());
  m.def("_thread_pool_set_backoff", [](bool on) { ThreadPool::instance().set_backoff_enabled(on); }, arg("enabled"));
  m.def("_thread_pool_throw_check", &throw_check, arg("n_threads"), arg("thrower"), arg("nested") = false,
        py::call_guard<py::gil_scoped_release>());
}
