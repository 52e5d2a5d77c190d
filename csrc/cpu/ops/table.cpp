// This ISA's kernel table (one per KOG_ISA_NS build).
#include "cpu/kernels.h"

#define KOG_STR2(x) #x
#define KOG_STR(x) KOG_STR2(x)

namespace kog::cpu::KOG_ISA_NS {

void rmsnorm(const RMSNormParams& p);
void rope(const RopeParams& p);
void silu_and_mul(const SiluAndMulParams& p);
void linear(const LinearParams& p, float* scratch);
void linear_part(const LinearParams& p, float* scratch, RowQueue& queue, uint32_t epoch, int part);
void kv_append(const KVAppendParams& p);
void paged_attention_decode(const PagedAttentionParams& p);
void paged_attention_prefill(const PagedAttentionParams& p);
void sample(const SampleParams& p);
void linear_quant(const LinearQuantParams& p);
void linear_quant_part(const LinearQuantParams& p, RowQueue& queue, uint32_t epoch, int part);
void dequantize_rows(const DequantizeRowsParams& p);

const KernelTable& kernel_table() {
  static const KernelTable table{KOG_STR(KOG_ISA_NS), &rmsnorm, &rope, &silu_and_mul, &linear, &linear_part,
                                 &kv_append, &paged_attention_decode, &paged_attention_prefill, &sample,
                                 &linear_quant, &linear_quant_part, &dequantize_rows};
  return table;
}

}  // namespace kog::cpu::KOG_ISA_NS
