// The float-GEMV instantiations of the persistent decode kernel (persistent_kernel.cuh), one per
// run dtype: the kernel of every model without FP8 or 4-bit weights.
#include "gpu/decode/persistent_kernel.cuh"

namespace kog::gpu::decode {

void* persistent_kernel_float(DType t) {
  void* k = nullptr;
  dispatch_float(t, [&](auto tag) { k = reinterpret_cast<void*>(&persistent_decode_kernel<decltype(tag), false>); });
  return k;
}

}  // namespace kog::gpu::decode
