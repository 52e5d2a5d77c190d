// The CPU kernel table: one instance per instruction set (csrc/cpu/ops/table.cpp is compiled
// once per ISA), the best supported one picked at run time (csrc/cpu/dispatch.cpp).
#pragma once
#include <string>
#include <vector>

#include "ops/activation.h"
#include "ops/linear.h"
#include "ops/linear_quant.h"
#include "ops/attention.h"
#include "ops/kv_append.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/sample.h"
#include "cpu/row_queue.h"

namespace kog::cpu {

struct KernelTable {
  const char* isa;
  void (*rmsnorm)(const RMSNormParams&);
  void (*rope)(const RopeParams&);
  void (*silu_and_mul)(const SiluAndMulParams&);
  void (*linear)(const LinearParams&, float* scratch);  // scratch: m * k floats
  // Thread `part` of queue.n_threads() computes its share of linear's output rows, taking row
  // chunks from the queue (csrc/cpu/row_queue.h; `epoch` distinct from the previous matrix's),
  // no threads of its own: for a caller already inside a parallel region (the decode
  // executor). scratch: m * k floats, the thread's own.
  void (*linear_part)(const LinearParams&, float* scratch, RowQueue& queue, uint32_t epoch, int part);
  void (*kv_append)(const KVAppendParams&);
  void (*paged_attention_decode)(const PagedAttentionParams&);
  void (*paged_attention_prefill)(const PagedAttentionParams&);
  void (*sample)(const SampleParams&);  // one thread; rows in order (csrc/ops/sample.h)
  void (*linear_quant)(const LinearQuantParams&);  // parallel over output rows (csrc/ops/linear_quant.h)
  // linear_quant's share of thread `part` inside a region (as linear_part): x quantized once
  // per thread into p.scratch (the thread's own, linear_quant_scratch_bytes(m, k)), then row
  // chunks from the queue.
  void (*linear_quant_part)(const LinearQuantParams&, RowQueue& queue, uint32_t epoch, int part);
  // Parallel over rows when there is enough work (csrc/ops/linear_quant.h).
  void (*dequantize_rows)(const DequantizeRowsParams&);
};

namespace generic { const KernelTable& kernel_table(); }
namespace avx2 { const KernelTable& kernel_table(); }
namespace avx512 { const KernelTable& kernel_table(); }

// The table in use: KOG_CPU_ISA if set and supported, else the best the CPU supports.
const KernelTable& kernels();
// ISAs built into this module that the running CPU supports, best last.
std::vector<std::string> supported_isas();
// Switches the table in use (tests run every kernel under every supported ISA).
void set_isa(const std::string& isa);
// Threads the CPU kernels use (OpenMP); KOG_NUM_THREADS or OMP_NUM_THREADS override.
int num_threads();

// The CPU's native bf16 matrix instructions, best first: "amx_bf16" (AMX tiles), "avx512_bf16"
// (VDPBF16PS), or "" (none). With either, torch's bf16 GEMM (oneDNN: bf16 products, fp32 sums,
// one rounding) beats an fp32 GEMM on upcast copies, which wins everywhere else
// (kog.program.interpreter.matmul; measured in docs/PERFORMANCE.md).
const char* bf16_gemm_unit();

// How the bf16 GEMV prefetches its weight stream ahead of its loads: a property of the CPU's
// caches and prefetchers, not of its ISA, so chosen at run time beside the kernel table.
//   kNone: the hardware prefetcher alone.  kT0: software prefetch into every level.
//   kNta:  non-temporal software prefetch (Intel: into L1 only, bypassing L2).
enum class WeightPrefetch : int { kNone = 0, kT0 = 1, kNta = 2 };
// The policy in use: KOG_CPU_PREFETCH (none, t0 or nta) if set, else by vendor (dispatch.cpp).
WeightPrefetch weight_prefetch();
// Switches the policy (tests run the bf16 GEMV under each; benches compare them).
void set_weight_prefetch(WeightPrefetch policy);
const char* weight_prefetch_name(WeightPrefetch policy);
// The policy named `name` (none, t0 or nta); throws InvalidArgument "<what>: expected ..." else.
WeightPrefetch weight_prefetch_named(const std::string& name, const std::string& what);

}  // namespace kog::cpu
