// Typed ids and the prefix-cache hash of the paged KV allocator. Plain C++, no GPU types.
#pragma once
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

namespace kog::kv {

// A strongly typed integer id: a BlockId cannot be passed where a HostBlockId is expected.
template <typename Tag, typename T>
struct Id {
  T value;
  constexpr explicit Id(T v = T(-1)) : value(v) {}
  constexpr bool valid() const { return value >= 0; }
  friend constexpr bool operator==(Id a, Id b) { return a.value == b.value; }
  friend constexpr bool operator!=(Id a, Id b) { return a.value != b.value; }
};

using BlockId = Id<struct BlockTag, int32_t>;          // a physical block of the device pool
using HostBlockId = Id<struct HostBlockTag, int32_t>;  // a physical block of the host swap pool
using SeqId = Id<struct SeqTag, int64_t>;              // chosen by the caller (the scheduler)
using PinId = Id<struct PinTag, int64_t>;              // returned by pin()

// The chained content hash of one full block: H(parent block's hash, the block's token ids).
// The first block of a chain hashes against the namespace seed (e.g. the model id), so two
// models never share a block. Lookups also compare the stored tokens and parent hash, so a
// 64-bit collision can only cause a miss, never a wrong hit.
struct BlockHash {
  uint64_t value = 0;
  friend bool operator==(BlockHash a, BlockHash b) { return a.value == b.value; }
  friend bool operator!=(BlockHash a, BlockHash b) { return a.value != b.value; }
};

inline uint64_t mix64(uint64_t x) {  // splitmix64 finalizer: full avalanche
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline BlockHash chain_hash(BlockHash parent, const int32_t* tokens, int32_t n) {
  uint64_t h = mix64(parent.value ^ 0x9e3779b97f4a7c15ULL) ^ static_cast<uint64_t>(n);
  int32_t i = 0;
  for (; i + 1 < n; i += 2) {  // two tokens per mixing round
    const uint64_t pair = (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) << 32) |
                          static_cast<uint32_t>(tokens[i + 1]);
    h = mix64(h + pair + 0x9e3779b97f4a7c15ULL);
  }
  if (i < n) h = mix64(h + static_cast<uint32_t>(tokens[i]) + 0x632be59bd9b4e019ULL);
  return BlockHash{h};
}

inline BlockHash namespace_seed(const std::string& ns) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a over the namespace bytes
  for (unsigned char c : ns) h = (h ^ c) * 0x100000001b3ULL;
  return BlockHash{mix64(h)};
}

}  // namespace kog::kv

template <>
struct std::hash<kog::kv::BlockHash> {
  size_t operator()(kog::kv::BlockHash h) const noexcept { return static_cast<size_t>(h.value); }
};
template <>
struct std::hash<kog::kv::SeqId> {
  size_t operator()(kog::kv::SeqId s) const noexcept { return std::hash<int64_t>()(s.value); }
};
template <>
struct std::hash<kog::kv::PinId> {
  size_t operator()(kog::kv::PinId s) const noexcept { return std::hash<int64_t>()(s.value); }
};
