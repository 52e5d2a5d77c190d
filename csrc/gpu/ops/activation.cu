// Host launcher of the GPU SiLU-and-mul (kernel: activation.cuh).
#include <climits>

#include "gpu/launch.h"
#include "gpu/ops/activation.cuh"

namespace kog::gpu {

void silu_and_mul(const SiluAndMulParams& p, void* stream) {
  KOG_CHECK(p.n_rows <= INT_MAX, "silu_and_mul: ", p.n_rows, " rows exceed one launch");
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kV = kVec16<T>;
    const int64_t align = kV * sizeof(T);
    const bool vec = p.d % kV == 0 && p.x_stride % kV == 0 && p.out_stride % kV == 0 &&
                     aligned_to(p.x, align) && aligned_to(p.out, align);
    const int64_t n_chunks = p.d / (vec ? kV : 1);
    const int threads = block_threads_for(n_chunks, kSiluMaxThreads);
    const dim3 grid(static_cast<unsigned>(p.n_rows),
                    static_cast<unsigned>((n_chunks + threads - 1) / threads));
    KOG_CHECK(grid.y <= 65535, "silu_and_mul: d = ", p.d, " is too wide for one launch");
    auto* kernel = vec ? &silu_and_mul_kernel<T, kV> : &silu_and_mul_kernel<T, 1>;
    kernel<<<grid, threads, 0, as_stream(stream)>>>(static_cast<T*>(p.out),
                                                    static_cast<const T*>(p.x), p.d, p.x_stride,
                                                    p.out_stride);
    KOG_GPU_CHECK_LAUNCH();
  });
}

}  // namespace kog::gpu
