// KOG_HOST_DEVICE marks a function both the host and the GPU kernels call (one definition for
// the CPU reference and the device code); plain inline in a host-only build.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KOG_HOST_DEVICE __host__ __device__
#else
#define KOG_HOST_DEVICE
#endif
