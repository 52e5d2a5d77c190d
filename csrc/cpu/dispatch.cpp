// Picks the CPU kernel table for the running CPU. Built with the baseline flags only.
#include "cpu/thread_pool.h"

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

#include "common/errors.h"
#include "cpu/kernels.h"

namespace kog::cpu {
namespace {

struct IsaEntry {
  const char* name;
  const KernelTable& (*table)();
  bool (*supported)();
};

bool always() { return true; }
#if defined(__x86_64__) || defined(_M_X64)
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") && has_avx2();
}
#endif

// Best last.
const std::vector<IsaEntry>& built_isas() {
  static const std::vector<IsaEntry> isas = {
#ifdef KOG_HAVE_ISA_GENERIC
      {"generic", &generic::kernel_table, &always},
#endif
#ifdef KOG_HAVE_ISA_AVX2
      {"avx2", &avx2::kernel_table, &has_avx2},
#endif
#ifdef KOG_HAVE_ISA_AVX512
      {"avx512", &avx512::kernel_table, &has_avx512},
#endif
  };
  return isas;
}

const KernelTable* pick(const std::string& wanted) {
  const KernelTable* best = nullptr;
  for (const auto& e : built_isas()) {
    if (!e.supported()) continue;
    if (!wanted.empty() && wanted == e.name) return &e.table();
    best = &e.table();
  }
  return best;
}

std::atomic<const KernelTable*> g_table{nullptr};

}  // namespace

const KernelTable& kernels() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (t == nullptr) {
    const char* env = std::getenv("KOG_CPU_ISA");
    t = pick(env != nullptr ? env : "");
    g_table.store(t, std::memory_order_release);
  }
  return *t;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const auto& e : built_isas())
    if (e.supported()) out.emplace_back(e.name);
  return out;
}

void set_isa(const std::string& isa) {
  for (const auto& e : built_isas()) {
    if (isa == e.name) {
      KOG_CHECK(e.supported(), "this CPU does not support the '", isa, "' kernels");
      g_table.store(&e.table(), std::memory_order_release);
      return;
    }
  }
  KOG_CHECK(false, "no CPU kernels named '", isa, "' in this build");
}

int num_threads() { return ThreadPool::instance().size(); }

const char* bf16_gemm_unit() {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1u))  // CPUID.(7,0):EDX[22] AMX-BF16
    return "amx_bf16";
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16")) return "avx512_bf16";
#endif
  return "";
}

namespace {
// Default by vendor, each as measured (docs/PERFORMANCE.md, "The bf16 GEMV's weight prefetch,
// by CPU"): on a 2-core Zen3 VM non-temporal prefetch 1 KiB ahead gave +9% bf16 decode over
// none, on a 2-core Zen5 VM +15%; on a 2-core Xeon VM (AVX-512 BF16) the same made bf16 decode
// 1.8x (SmolLM2) to 2x (MoE) slower than none, and T0 1.1-1.2x faster than none. Other vendors: T0 (untested).
WeightPrefetch default_weight_prefetch() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd")) return WeightPrefetch::kNta;
#endif
  return WeightPrefetch::kT0;
}

WeightPrefetch initial_weight_prefetch() {
  const char* env = std::getenv("KOG_CPU_PREFETCH");
  if (env == nullptr || *env == '\0') return default_weight_prefetch();
  return weight_prefetch_named(env, std::string("KOG_CPU_PREFETCH=") + env);
}

std::atomic<int> g_prefetch{-1};
}  // namespace

const char* weight_prefetch_name(WeightPrefetch policy) {
  switch (policy) {
    case WeightPrefetch::kT0: return "t0";
    case WeightPrefetch::kNta: return "nta";
    default: return "none";
  }
}

WeightPrefetch weight_prefetch_named(const std::string& name, const std::string& what) {
  for (WeightPrefetch p : {WeightPrefetch::kNone, WeightPrefetch::kT0, WeightPrefetch::kNta})
    if (name == weight_prefetch_name(p)) return p;
  KOG_CHECK(false, what, ": expected none, t0 or nta");
  return WeightPrefetch::kNone;
}

WeightPrefetch weight_prefetch() {
  int p = g_prefetch.load(std::memory_order_relaxed);
  if (p < 0) {
    p = int(initial_weight_prefetch());
    g_prefetch.store(p, std::memory_order_relaxed);
  }
  return WeightPrefetch(p);
}

void set_weight_prefetch(WeightPrefetch policy) { g_prefetch.store(int(policy), std::memory_order_relaxed); }

}  // namespace kog::cpu
