// Device discovery for `kog info` and the Python layer.
#include "gpu/compat.cuh"
#include "gpu/launch.h"

namespace kog::gpu {

std::vector<DeviceInfo> devices() {
  std::vector<DeviceInfo> out;
  int count = 0;
  // No driver, no device or a broken install all mean "no GPU here": clear the sticky error
  // and report none.
  if (gpuGetDeviceCount(&count) != gpuSuccess) {
    (void)gpuGetLastError();
    return out;
  }
  for (int i = 0; i < count; ++i) {
    gpuDeviceProp_t prop;
    if (gpuGetDeviceProperties(&prop, i) != gpuSuccess) {
      (void)gpuGetLastError();
      continue;
    }
    out.push_back(DeviceInfo{i, prop.name, gpu_arch_name(prop),
                             static_cast<int64_t>(prop.totalGlobalMem), prop.multiProcessorCount,
                             prop.warpSize, static_cast<int64_t>(prop.sharedMemPerBlock)});
  }
  return out;
}

std::string runtime_version() { return gpu_runtime_version(); }

}  // namespace kog::gpu
