// Host launcher of the GPU RMSNorm (kernel: rmsnorm.cuh).
#include <climits>

#include "gpu/launch.h"
#include "gpu/ops/rmsnorm.cuh"

namespace kog::gpu {

void rmsnorm(const RMSNormParams& p, void* stream) {
  KOG_CHECK(p.n_rows <= INT_MAX, "rmsnorm: ", p.n_rows, " rows exceed one launch");
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kV = kVec16<T>;
    const int64_t align = kV * sizeof(T);
    const bool vec = p.hidden % kV == 0 && p.x_stride % kV == 0 && p.out_stride % kV == 0 &&
                     aligned_to(p.x, align) && aligned_to(p.out, align) &&
                     aligned_to(p.weight, align) &&
                     (p.residual == nullptr ||
                      (p.residual_stride % kV == 0 && aligned_to(p.residual, align)));
    const int n = vec ? kV : 1;
    const int threads = block_threads_for(p.hidden / n, kRmsnormMaxThreads);
    auto* kernel = vec ? &rmsnorm_kernel<T, kV> : &rmsnorm_kernel<T, 1>;
    kernel<<<static_cast<unsigned>(p.n_rows), threads, 0, as_stream(stream)>>>(
        static_cast<T*>(p.out), static_cast<const T*>(p.x), static_cast<T*>(p.residual),
        static_cast<const T*>(p.weight), p.hidden, p.x_stride, p.out_stride, p.residual_stride,
        p.eps);
    KOG_GPU_CHECK_LAUNCH();
  });
}

}  // namespace kog::gpu
