// A cheap monotonic clock for the tensor-parallel transport's hot paths (engine/shm_transport):
// the time-stamp counter on x86-64 where it is invariant (cpuid 0x80000007 EDX bit 8: one rate
// in every power state, which Linux keeps in step across cores), else steady_clock nanoseconds.
// A read is one RDTSC (~12 ns on the dev VM) instead of a vDSO clock_gettime (~38 ns): a delayed
// gather reads the clock four times. Ticks of one machine compare across processes (the same
// counter, or CLOCK_MONOTONIC); each process calibrates their rate once against steady_clock.
//
//   tick_clock::init();                       // once, before the first now() (idempotent)
//   const uint64_t t = tick_clock::now();
//   double s = double(tick_clock::now() - t) * tick_clock::seconds_per_tick();
#pragma once
#include <chrono>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <x86intrin.h>
#endif

namespace kog::engine::tick_clock {

struct State {
  bool tsc = false;               // now() reads the time-stamp counter
  double seconds_per_tick = 1e-9; // steady_clock: nanoseconds
};
extern State g_state;

// Picks the counter and calibrates it (about 2 ms, the first call only; thread-safe).
void init();

inline double seconds_per_tick() { return g_state.seconds_per_tick; }

inline uint64_t now() {
#if defined(__x86_64__) || defined(_M_X64)
  if (g_state.tsc) return __rdtsc();
#endif
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}

// Ticks in `seconds` (rounded down; at most 2^62: a timeout of years stays a timeout).
inline uint64_t ticks(double seconds) {
  const double t = seconds / g_state.seconds_per_tick;
  return t >= 4.6e18 ? uint64_t(1) << 62 : t <= 0 ? 0 : uint64_t(t);
}

}  // namespace kog::engine::tick_clock
