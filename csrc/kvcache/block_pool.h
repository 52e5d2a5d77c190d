// The device block pool: reference counts, parent links, the free stack, the prefix-cache map and
// the LRU list of cached blocks. One class, one job: it knows blocks, not sequences.
//
// A device block is in exactly one state:
//   free        ref == 0, on the free stack, holds nothing
//   referenced  ref > 0 (ref = child blocks linking to it + sequences whose tail it is + pins)
//   cached      ref == 0, registered in the prefix-cache map, on the LRU list (evictable)
//
// Blocks form a forest through parent links: a sequence owns only its tail block; every block
// holds one reference on its parent. So a fork costs O(1) (one ref on the shared tail) and
// releasing a block cascades up the chain while counts reach zero.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "kvcache/ids.h"

namespace kog::kv {

class BlockPool {
 public:
  BlockPool(int32_t num_blocks, int32_t block_size);

  // ---- public API ------------------------------------------------------------------------
  int32_t num_blocks() const { return num_blocks_; }
  int32_t block_size() const { return block_size_; }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_cached() const { return num_cached_; }
  int32_t num_used() const { return num_blocks_ - num_free() - num_cached_; }
  // Blocks an allocation may take right now: free ones, then evicted cached ones.
  int32_t num_reclaimable() const { return num_free() + num_cached_; }

  // Takes the top of the free stack, else evicts the LRU cached block. Returns it with ref 1,
  // no parent, no hash. NOTE: the caller must have checked num_reclaimable() > 0.
  BlockId allocate();
  // Drops one reference; a block reaching zero becomes cached (if registered) or free, and
  // releases its own reference on its parent, and so on up the chain.
  void release(BlockId b);
  void add_ref(BlockId b) { ++ref_[b.value]; }
  // Takes a reference on a cached block (ref 0 -> 1, leaves the LRU list) and links it under
  // `parent` (whose reference the caller has already arranged).
  void revive(BlockId b, BlockId parent);
  // Sets b's parent link without touching any count (the caller transfers a reference).
  void link(BlockId b, BlockId parent) { parent_[b.value] = parent.value; }
  // Evicts up to n cached blocks in LRU order; returns how many.
  int32_t evict(int32_t n);

  int32_t ref(BlockId b) const { return ref_[b.value]; }
  BlockId parent(BlockId b) const { return BlockId(parent_[b.value]); }
  int32_t* tokens(BlockId b) { return &tokens_[static_cast<size_t>(b.value) * block_size_]; }
  const int32_t* tokens(BlockId b) const {
    return &tokens_[static_cast<size_t>(b.value) * block_size_];
  }

  // ---- prefix cache ----------------------------------------------------------------------
  bool hashed(BlockId b) const { return hashed_[b.value] != 0; }
  bool registered(BlockId b) const { return registered_[b.value] != 0; }
  BlockHash hash(BlockId b) const { return hash_[b.value]; }
  BlockHash parent_hash(BlockId b) const { return parent_hash_[b.value]; }
  // Records the hash of a now-full block and registers it unless the hash is already mapped
  // (then the block is a duplicate: it keeps its hash for the chain but is not cached).
  void seal(BlockId b, BlockHash h, BlockHash parent_h);
  // Forgets the hash (the block is about to be written) and unregisters it.
  void unseal(BlockId b);
  // The registered block for h whose stored parent hash and tokens match, or an invalid id.
  BlockId find(BlockHash h, BlockHash parent_h, const int32_t* tokens) const;

  // ---- introspection (tests, stats) ------------------------------------------------------
  std::vector<int32_t> free_stack() const { return free_; }
  std::vector<int32_t> lru_order() const;  // head (evicted first) to tail
  const std::unordered_map<BlockHash, int32_t>& cache_map() const { return map_; }
  int64_t evictions() const { return evictions_; }

 private:
  // ---- internal helpers ------------------------------------------------------------------
  void lru_push_back(int32_t b);
  void lru_remove(int32_t b);
  void drop_hash(int32_t b);

  int32_t num_blocks_, block_size_;
  std::vector<int32_t> ref_, parent_;
  std::vector<int32_t> free_;  // a stack: the last pushed is reused first
  std::vector<BlockHash> hash_, parent_hash_;
  std::vector<uint8_t> hashed_, registered_;
  std::vector<int32_t> tokens_;  // [num_blocks, block_size] token ids written into each block
  // NOTE: the LRU list holds exactly the registered blocks with ref 0 (the cached state).
  std::vector<int32_t> lru_prev_, lru_next_;
  int32_t lru_head_ = -1, lru_tail_ = -1, num_cached_ = 0;
  std::unordered_map<BlockHash, int32_t> map_;
  int64_t evictions_ = 0;
};

}  // namespace kog::kv
