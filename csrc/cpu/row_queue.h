// Work-stealing split of one matrix's output rows over the threads of a parallel region.
//
// Thread t owns a contiguous slice of chunks (the static balanced split) and takes them front
// to back, so what it reads of the weights stays ONE sequential stream (the CPU GEMV depends on
// that: csrc/cpu/ops/linear.cpp). A thread whose slice is empty takes chunks from the BACK of
// the slice with the most chunks left, so a slow thread (a busy sibling hyperthread, a noisy
// neighbour) no longer holds the whole region at the barrier.
//
//   RowQueue q(n_threads);            // once; reused for every matrix
//   // inside the region, every thread, for the matrix with epoch e (distinct for consecutive
//   // matrices; the barrier between matrices orders them):
//   q.start(e, t, n_chunks);
//   for (int64_t c; (c = q.next(e, t)) >= 0;) process(chunk c);
//
// Invariant: each chunk of [0, n_chunks) is returned exactly once, to one thread, per epoch.
// A thread that starts late only loses the chance to be helped (a thief skips slices not yet
// started for this epoch); it still takes all of its own slice.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>

namespace kog::cpu {

class RowQueue {
 public:
  explicit RowQueue(int n_threads) : n_(n_threads), slices_(new Slice[n_threads]) {}

  int n_threads() const { return n_; }

  // Opens thread t's slice of [0, n_chunks) for epoch e; called by thread t only.
  void start(uint32_t e, int t, int64_t n_chunks) {
    const int64_t lo = n_chunks * t / n_, hi = n_chunks * (t + 1) / n_;
    slices_[t].state.store(pack(e, lo, hi), std::memory_order_release);
  }

  // Next chunk for thread t in epoch e, or -1 when every chunk of the epoch is taken.
  int64_t next(uint32_t e, int t) {
    const int64_t own = take(slices_[t].state, e, /*front=*/true);
    if (own >= 0) return own;
    for (;;) {  // steal from the back of the fullest slice
      int victim = -1;
      int64_t most = 0;
      for (int u = 0; u < n_; ++u) {
        const uint64_t v = slices_[u].state.load(std::memory_order_acquire);
        if (epoch(v) == (e & kEpochMask) && hi(v) - lo(v) > most) most = hi(v) - lo(v), victim = u;
      }
      if (victim < 0) return -1;
      const int64_t c = take(slices_[victim].state, e, /*front=*/false);
      if (c >= 0) return c;
    }
  }

 private:
  // state = epoch:16 | lo:24 | hi:24 (chunk indices; a matrix has < 2^24 chunks).
  static constexpr uint64_t kEpochMask = 0xffff, kIdxMask = 0xffffff;
  static uint64_t pack(uint32_t e, int64_t lo, int64_t hi) {
    return (uint64_t(e) & kEpochMask) << 48 | (uint64_t(lo) & kIdxMask) << 24 | (uint64_t(hi) & kIdxMask);
  }
  static uint32_t epoch(uint64_t v) { return uint32_t(v >> 48); }
  static int64_t lo(uint64_t v) { return int64_t((v >> 24) & kIdxMask); }
  static int64_t hi(uint64_t v) { return int64_t(v & kIdxMask); }

  static int64_t take(std::atomic<uint64_t>& s, uint32_t e, bool front) {
    uint64_t v = s.load(std::memory_order_acquire);
    for (;;) {
      if (epoch(v) != (e & kEpochMask) || lo(v) >= hi(v)) return -1;
      const uint64_t nv = front ? pack(e, lo(v) + 1, hi(v)) : pack(e, lo(v), hi(v) - 1);
      if (s.compare_exchange_weak(v, nv, std::memory_order_acq_rel, std::memory_order_acquire))
        return front ? lo(v) : hi(v) - 1;
    }
  }

  struct alignas(64) Slice {
    std::atomic<uint64_t> state{0};
  };
  int n_;
  std::unique_ptr<Slice[]> slices_;
};

}  // namespace kog::cpu
