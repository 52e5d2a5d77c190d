// A tensor-parallel rank's exchange memory, shared with the other ranks' processes on one host:
// its inbox and flags (gpu/decode/rank_items.cuh), allocated on the current device, exported as
// IPC handles, and every other rank's mapped here from theirs. Plain C++ (no vendor types);
// implemented in peer_segment.cu (cuda/rocm builds).
//
//   PeerSegment seg(ex.inbox_bytes(), ex.flag_count());  // this rank's, zeroed
//   std::string h = seg.handle();                         // to every rank (torch.distributed)
//   seg.open(every_ranks_handle, rank);                   // the others' mapped into this process
//   ex.set_ranks(seg.inboxes(), seg.flags());
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kog::gpu::decode {

class PeerSegment {
 public:
  PeerSegment(int64_t inbox_bytes, int64_t flag_count);
  ~PeerSegment();
  PeerSegment(const PeerSegment&) = delete;
  PeerSegment& operator=(const PeerSegment&) = delete;

  // The inbox's and the flags' IPC handles, concatenated (bytes for another process's open()).
  std::string handle() const;
  // Maps every other rank's segment (handles[q]: rank q's handle(); handles[rank]: this one's,
  // not opened). Once.
  void open(const std::vector<std::string>& handles, int rank);
  // [ranks] device addresses of every rank's inbox and flags as this process maps them (after open).
  const std::vector<uintptr_t>& inboxes() const { return inboxes_; }
  const std::vector<uintptr_t>& flags() const { return flags_; }

 private:
  void* inbox_ = nullptr;            // device [inbox_bytes]
  void* flag_mem_ = nullptr;         // device [flag_count] uint64, signal memory (gpu_malloc_signals)
  std::vector<void*> opened_;        // other ranks' mappings, closed by the destructor
  std::vector<uintptr_t> inboxes_, flags_;
};

}  // namespace kog::gpu::decode
