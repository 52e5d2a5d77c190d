// The instantiation of the persistent decode kernel (persistent_kernel.cuh) with the GEMVs over
// GPU weight formats (FP8, 4-bit groups, Q4_K): the kernel of a model with any such weight, for
// bf16 runs only. Every weight path in one kernel costs minutes of compile per target (LLVM's
// register allocation of the AGPR spills on CDNA most of all), so there is one such kernel, for
// the activation type FP8 and 4-bit models are served with; an f16 run dequantizes instead.
#include "gpu/decode/persistent_kernel.cuh"

namespace kog::gpu::decode {

void* persistent_kernel_quant(DType t) {
  return t == DType::kBF16 ? reinterpret_cast<void*>(&persistent_decode_kernel<gpu_bf16, true>) : nullptr;
}

}  // namespace kog::gpu::decode
