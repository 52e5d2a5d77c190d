#include "cpu/thread_pool.h"

#include <chrono>
#include <cstdlib>
#include <exception>
#include <new>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kog::cpu {
namespace {

// Threads of the region this thread is running a function of; 0 outside every region.
thread_local int t_region_threads = 0;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Sleeps while *addr == old (returns at once if it already differs, or spuriously).
void futex_wait(const std::atomic<uint32_t>* addr, uint32_t old) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(addr), FUTEX_WAIT_PRIVATE, old, nullptr, nullptr, 0);
#else
  if (addr->load(std::memory_order_acquire) == old) std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

void futex_wake_all(const std::atomic<uint32_t>* addr) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
}

int env_threads() {
  for (const char* var : {"KOG_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* v = std::getenv(var)) {
      const int n = std::atoi(v);
      if (n > 0) return n;
    }
  }
  return 0;
}

int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

void WaitWord::bump() {
  v_.fetch_add(1, std::memory_order_seq_cst);
  // NOTE: a sleeper increments sleepers_ (seq_cst) before its last check of the word, and the
  // word was bumped (seq_cst) before this read: one of the two sees the other, so no sleeper
  // misses its wake, and the common case (nobody asleep) costs no system call.
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&v_);
}

int64_t WaitWord::wait_while(uint32_t old, int64_t& spin_ns) const {
  if (v_.load(std::memory_order_acquire) != old) return 0;
  const int64_t start = now_ns(), deadline = start + spin_ns;
  const int64_t busy_until = start + std::min(spin_ns, kMaxSpinNs);
  for (int i = 1;; ++i) {
    cpu_relax();
    if (v_.load(std::memory_order_acquire) != old) {
      spin_ns = std::min(kMaxSpinNs, spin_ns * 2);
      return 0;
    }
    if (i % 32 == 0) {
      const int64_t now = now_ns();
      if (now >= deadline) break;
      // Past kMaxSpinNs (a parked worker's longer budget): poll, but give the core to any
      // other runnable thread first (torch's OpenMP workers during a prefill GEMM).
      if (now >= busy_until) std::this_thread::yield();
    }
  }
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  while (v_.load(std::memory_order_seq_cst) == old) futex_wait(&v_, old);
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
  // NOTE: only a wait of a time slice (another process held the awaited thread's core) shrinks
  // the budget; a long op on an idle machine must not teach the threads to sleep at every
  // barrier (a sleep and wake-up costs ~10-50 us, ~200 barriers a decode step).
  const int64_t took = now_ns() - start;
  if (took > kSliceNs) spin_ns = std::max(kMinSpinNs, spin_ns / 2);
  return took;
}

namespace {
// Spin budget of this thread's barrier waits (and the caller's wait for its workers), adapted by
// wait_while. Parking between regions has its own budget (park_spin_ns_), which must not shrink
// the barriers' one.
thread_local int64_t t_spin_ns = WaitWord::kMaxSpinNs;
}  // namespace

ThreadPool& ThreadPool::instance() {
  // NOTE: never destroyed: worker threads must not be joined from a static destructor (the
  // interpreter may exit while a region runs on another thread).
  static ThreadPool* pool = new ThreadPool();
  return *pool;
}

ThreadPool::ThreadPool() : size_(env_threads() > 0 ? env_threads() : available_cpus()) {
#if defined(__linux__)
  // A forked child has none of the parent's workers: forget them (never join) and start anew.
  pthread_atfork(nullptr, nullptr, [] {
    ThreadPool& p = instance();
    for (auto& w : p.workers_) w.detach();
    p.workers_.clear();
    new (&p.region_mu_) std::mutex();
  });
#endif
}

ThreadPool::~ThreadPool() { stop_workers(); }

bool ThreadPool::in_region() { return t_region_threads > 0; }

void ThreadPool::set_size(int n) { size_.store(std::max(1, n), std::memory_order_relaxed); }

void ThreadPool::start_workers(int n) {
  while (int(workers_.size()) < n - 1) {
    // NOTE: the worker starts from the generation current now, before the caller bumps it to
    // start the region this worker is created for (the thread may first run after the bump).
    const int t = int(workers_.size()) + 1;
    const uint32_t gen = start_.load();
    workers_.emplace_back([this, t, gen] { worker(t, gen); });
  }
}

void ThreadPool::stop_workers() {
  std::lock_guard<std::mutex> lock(region_mu_);
  stop_ = true;
  start_.bump();
  for (auto& w : workers_) w.join();
  workers_.clear();
  stop_ = false;
}

// NOTE: every worker acknowledges every region, also one it has no part in, and the next
// region starts only after all acknowledgements: so a worker always reads the fn_ and nt_ of
// the generation it woke for, and sees each generation exactly once.
void ThreadPool::worker(int t, uint32_t seen) {
  for (;;) {
    int64_t park_spin_ns = park_spin_ns_.load(std::memory_order_relaxed);
    start_.wait_while(seen, park_spin_ns);
    seen = start_.load();
    if (stop_) return;
    if (t < nt_) {
      t_region_threads = nt_;
      try {
        (*fn_)(t, nt_);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      t_region_threads = 0;
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_word_.bump();
  }
}

void ThreadPool::run(int n, const std::function<void(int, int)>& fn) {
  n = std::min(n, size());
  std::unique_lock<std::mutex> lock(region_mu_, std::defer_lock);
  if (n <= 1 || t_region_threads > 0 || !lock.try_lock() || now_ns() < backoff_until_ns_) {
    const int outer = t_region_threads;
    t_region_threads = 1;
    struct Restore { int v; ~Restore() { t_region_threads = v; } } restore{outer};
    fn(0, 1);
    return;
  }
  start_workers(n);
  fn_ = &fn;
  nt_ = n;
  error_ = nullptr;
  barrier_count_.store(0, std::memory_order_relaxed);
  pending_.store(int(workers_.size()), std::memory_order_relaxed);
  const uint32_t done = done_word_.load();
  start_.bump();  // seq_cst: the workers see fn_, nt_ and pending_
  t_region_threads = n;
  std::exception_ptr mine;
  try {
    fn(0, n);
  } catch (...) {
    mine = std::current_exception();
  }
  t_region_threads = 0;
  while (pending_.load(std::memory_order_acquire) != 0) done_word_.wait_while(done, t_spin_ns);
  note_contention(long_waits_.exchange(0, std::memory_order_relaxed));
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::barrier() {
  if (t_region_threads <= 1) return;
  const uint32_t gen = barrier_word_.load();
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) == t_region_threads - 1) {
    // NOTE: nobody can arrive at the next barrier before seeing this bump, so resetting the
    // count first is safe.
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_word_.bump();
  } else {
    if (barrier_word_.wait_while(gen, t_spin_ns) > kLongWaitNs) long_waits_.fetch_add(1, std::memory_order_relaxed);
  }
}

// NOTE: a barrier wait longer than a scheduler time slice means a thread of the region was not
// running: another process holds its core. Then every barrier of the region can cost a time
// slice, and one thread (which never waits) is faster than the team: regions run on the caller
// alone for a while, which doubles while contention persists and is probed again with the
// whole team when it ends.
void ThreadPool::note_contention(int long_waits) {
  contention_ = contention_ / 2 + long_waits;
  park_spin_ns_.store(contention_ > 0 ? WaitWord::kMaxSpinNs : kParkSpinNs, std::memory_order_relaxed);
  if (contention_ >= kContentionTrigger && backoff_enabled_.load(std::memory_order_relaxed)) {
    backoff_until_ns_ = now_ns() + backoff_ns_;
    backoff_ns_ = std::min(kMaxBackoffNs, backoff_ns_ * 2);
    contention_ = 0;
    backoffs_.fetch_add(1, std::memory_order_relaxed);
  } else if (long_waits == 0) {
    backoff_ns_ = kBaseBackoffNs;
  }
}

void ThreadPool::reset_contention() {
  std::lock_guard<std::mutex> lock(region_mu_);
  contention_ = 0;
  backoff_until_ns_ = 0;
  backoff_ns_ = kBaseBackoffNs;
}

bool ThreadPool::backing_off() const { return now_ns() < backoff_until_ns_.load(std::memory_order_relaxed); }

}  // namespace kog::cpu
