// The transport's tick clock. Contract: tick_clock.h.
#include "engine/tick_clock.h"

#include <mutex>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace kog::engine::tick_clock {

State g_state;

namespace {

bool invariant_tsc() {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0x80000000u, nullptr) < 0x80000007u) return false;
  __cpuid(0x80000007u, a, b, c, d);
  return (d >> 8) & 1u;
#else
  return false;
#endif
}

}  // namespace

void init() {
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(__x86_64__) || defined(_M_X64)
    if (!invariant_tsc()) return;
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    const uint64_t c0 = __rdtsc();
    auto t1 = t0;
    while (t1 - t0 < std::chrono::milliseconds(2)) t1 = clock::now();
    const uint64_t c1 = __rdtsc();
    const double s = std::chrono::duration<double>(t1 - t0).count();
    if (c1 <= c0) return;  // a counter that did not advance: stay on steady_clock
    g_state.seconds_per_tick = s / double(c1 - c0);
    g_state.tsc = true;
#endif
  });
}

}  // namespace kog::engine::tick_clock
