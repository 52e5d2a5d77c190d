// Kog's CPU worker threads: parallel regions whose waits spin briefly, then sleep.
//
// Why not OpenMP: libgomp's default wait policy spins ~300k iterations at every barrier and
// between regions. The decode step meets at a barrier before ~8 of each layer's 10 ops, so when
// another process holds a core (an agent's compiler next to its model), the thread that
// arrives first burns its time slice waiting for one that is not running: 0.8 tok/s where one
// thread makes 30. Here every wait spins for at most a budget that adapts (it halves each time
// a wait lasted a time slice, so under contention the threads yield the CPU almost at once, and
// grows back while waits end within it), then sleeps on a futex; and while barrier waits of a
// time slice recur, regions run on the caller alone (note_contention).
//
//   ThreadPool& pool = ThreadPool::instance();
//   pool.run(n, [&](int t, int nt) {   // t in [0, nt), the caller is t = 0
//     ... pool.barrier(); ...          // every thread of the region
//   });
//
// A function that throws has its first exception rethrown by run, after every thread has
// returned; a function that uses barrier() must not throw (the others would wait for it):
// validate before the region.
//
// Invariants: one region at a time (a second caller, or a call from inside a region, runs its
// function on its own thread as a region of one); run returns after every thread's fn has
// returned, and what they wrote is visible to the caller; a barrier orders everything written
// before it by any thread of the region before everything after it.
#pragma once
#include <algorithm>
#include <atomic>
#include <exception>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kog::cpu {

// A 32-bit word that threads wait on until it changes: spin (adaptive budget), then futex.
class WaitWord {
 public:
  uint32_t load() const { return v_.load(std::memory_order_acquire); }
  // Adds 1 (release) and wakes every sleeper.
  void bump();
  // Returns once the word differs from `old` (acquire): 0 if within the spin, else the ns the
  // whole wait took. `spin_ns` is the caller's adaptive budget: halved when this wait lasted
  // over kSliceNs (the awaited thread was not running), doubled (to kMaxSpinNs) when it ended
  // within the spin.
  int64_t wait_while(uint32_t old, int64_t& spin_ns) const;

  static constexpr int64_t kMaxSpinNs = 50'000, kMinSpinNs = 500;
  static constexpr int64_t kSliceNs = 1'000'000;  // a wait this long: a scheduler time slice

 private:
  alignas(64) std::atomic<uint32_t> v_{0};
  mutable std::atomic<int32_t> sleepers_{0};
};

class ThreadPool {
 public:
  static ThreadPool& instance();

  // Threads a region may use, the caller included (KOG_NUM_THREADS, else OMP_NUM_THREADS,
  // else the CPUs this process may run on).
  int size() const { return size_.load(std::memory_order_relaxed); }
  // n >= 1; takes effect at the next region.
  void set_size(int n);

  // fn(t, nt) on nt = min(n, size()) threads; see the invariants above.
  void run(int n, const std::function<void(int, int)>& fn);
  // Inside a region: waits for every thread of the region.
  void barrier();

  // Contention back-off (see note_contention): regions run on the caller alone until then.
  bool backing_off() const;
  int64_t backoffs() const { return backoffs_.load(std::memory_order_relaxed); }
  void reset_contention();
  void set_backoff_enabled(bool on) { backoff_enabled_.store(on, std::memory_order_relaxed); }

  static constexpr int64_t kLongWaitNs = WaitWord::kSliceNs;  // a barrier wait this long: contention
  static constexpr int kContentionTrigger = 2;             // long waits (decayed by half a region)
  static constexpr int64_t kBaseBackoffNs = 100'000'000;   // first back-off: 100 ms
  static constexpr int64_t kMaxBackoffNs = 1'600'000'000;  // doubling up to 1.6 s
  static constexpr int64_t kParkSpinNs = 2'000'000;        // see park_spin_ns_

  // True on a thread that is running a region's function.
  static bool in_region();

  ~ThreadPool();

 private:
  ThreadPool();
  void start_workers(int n);  // holds region_mu_
  void stop_workers();
  void worker(int t, uint32_t seen);
  void note_contention(int long_waits);  // holds region_mu_  // seen: the start_ generation before its first region

  std::atomic<int> size_;
  std::mutex region_mu_;  // one region at a time
  std::vector<std::thread> workers_;  // workers_[i] is thread t = i + 1
  WaitWord start_;        // bumped to start a region (or to stop)
  WaitWord done_word_;    // bumped by the last worker to finish a region
  alignas(64) std::atomic<int> pending_{0};  // workers of the current region still running
  WaitWord barrier_word_;
  alignas(64) std::atomic<int> barrier_count_{0};
  const std::function<void(int, int)>* fn_ = nullptr;  // the current region's function
  int nt_ = 1;                                          // the current region's thread count
  bool stop_ = false;
  std::mutex error_mu_;
  std::exception_ptr error_;  // the first exception a worker's fn threw in this region
  alignas(64) std::atomic<int> long_waits_{0};  // barrier waits > kLongWaitNs in this region
  // Guarded by region_mu_ (written after regions), read racily by run's fast check:
  int contention_ = 0;
  std::atomic<int64_t> backoffs_{0};
  std::atomic<bool> backoff_enabled_{true};
  // NOTE: a worker parked between regions polls for kParkSpinNs before it sleeps, so that on an
  // idle machine it is still awake when the next decode step starts (the host's work between
  // steps is ~0.2-2 ms; a sleeping worker costs the step a wake-up, ~50-500 us on a VM, since
  // the step's first barrier waits for it). Past kMaxSpinNs it yields the core before each
  // poll (torch's OpenMP workers run the prefill GEMMs between Kog's regions); kMaxSpinNs only
  // while barrier waits of a time slice were seen lately (note_contention).
  std::atomic<int64_t> park_spin_ns_{kParkSpinNs};
  std::atomic<int64_t> backoff_until_ns_{0};
  int64_t backoff_ns_ = kBaseBackoffNs;
};

// fn(i) for i in [0, n) split statically over a region (on the caller alone when `parallel`
// is false, n < 2 or the caller is already in a region).
template <typename Fn>
void parallel_for(int64_t n, bool parallel, Fn&& fn) {
  ThreadPool& pool = ThreadPool::instance();
  if (!parallel || n < 2 || pool.size() == 1 || ThreadPool::in_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  pool.run(int(std::min<int64_t>(n, pool.size())), [&](int t, int nt) {
    for (int64_t i = n * t / nt, end = n * (t + 1) / nt; i < end; ++i) fn(i);
  });
}

}  // namespace kog::cpu
