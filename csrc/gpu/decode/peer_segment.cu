// PeerSegment: IPC-shared inbox and flags of a tensor-parallel rank. Contract: peer_segment.h.
#include "gpu/decode/peer_segment.h"

#include <cstring>

#include "common/errors.h"
#include "gpu/compat.cuh"

namespace kog::gpu::decode {

PeerSegment::PeerSegment(int64_t inbox_bytes, int64_t flag_count) {
  KOG_CHECK(inbox_bytes > 0 && flag_count > 0, "peer segment: inbox of ", inbox_bytes, " bytes, ", flag_count,
            " flags");
  KOG_GPU_CHECK(gpuMalloc(&inbox_, size_t(inbox_bytes)));
  KOG_GPU_CHECK(gpu_malloc_signals(&flag_mem_, size_t(flag_count) * sizeof(uint64_t)));
  KOG_GPU_CHECK(gpuMemsetAsync(flag_mem_, 0, size_t(flag_count) * sizeof(uint64_t), nullptr));  // epochs start at 0
  KOG_GPU_CHECK(gpuStreamSynchronize(nullptr));
}

PeerSegment::~PeerSegment() {
  // Closes and frees cannot throw out of a destructor: errors here are dropped.
  for (void* p : opened_) (void)gpuIpcCloseMemHandle(p);
  (void)gpuFree(flag_mem_);
  (void)gpuFree(inbox_);
}

std::string PeerSegment::handle() const {
  gpuIpcMemHandle_t h[2];
  KOG_GPU_CHECK(gpuIpcGetMemHandle(&h[0], inbox_));
  KOG_GPU_CHECK(gpuIpcGetMemHandle(&h[1], flag_mem_));
  return std::string(reinterpret_cast<const char*>(h), sizeof(h));
}

void PeerSegment::open(const std::vector<std::string>& handles, int rank) {
  KOG_CHECK(inboxes_.empty(), "peer segment: opened twice");
  KOG_CHECK(rank >= 0 && size_t(rank) < handles.size(), "peer segment: rank ", rank, " of ", handles.size());
  for (size_t q = 0; q < handles.size(); ++q) {
    if (int(q) == rank) {
      inboxes_.push_back(reinterpret_cast<uintptr_t>(inbox_));
      flags_.push_back(reinterpret_cast<uintptr_t>(flag_mem_));
      continue;
    }
    gpuIpcMemHandle_t h[2];
    KOG_CHECK(handles[q].size() == sizeof(h), "peer segment: rank ", q, "'s handle is ", handles[q].size(),
              " bytes, not ", sizeof(h));
    std::memcpy(h, handles[q].data(), sizeof(h));
    void* mapped[2] = {nullptr, nullptr};
    for (int k = 0; k < 2; ++k) {
      KOG_GPU_CHECK(gpuIpcOpenMemHandle(&mapped[k], h[k], gpuIpcMemLazyEnablePeerAccess));
      opened_.push_back(mapped[k]);
    }
    inboxes_.push_back(reinterpret_cast<uintptr_t>(mapped[0]));
    flags_.push_back(reinterpret_cast<uintptr_t>(mapped[1]));
  }
}

}  // namespace kog::gpu::decode
