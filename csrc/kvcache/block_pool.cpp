#include "kvcache/block_pool.h"

#include <cstring>

#include "common/errors.h"

namespace kog::kv {

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      ref_(num_blocks, 0),
      parent_(num_blocks, -1),
      hash_(num_blocks),
      parent_hash_(num_blocks),
      hashed_(num_blocks, 0),
      registered_(num_blocks, 0),
      tokens_(static_cast<size_t>(num_blocks) * block_size, 0),
      lru_prev_(num_blocks, -1),
      lru_next_(num_blocks, -1) {
  KOG_CHECK(num_blocks > 0, "num_blocks must be > 0, got ", num_blocks);
  KOG_CHECK(block_size > 0, "block_size must be > 0, got ", block_size);
  free_.reserve(num_blocks);
  // Pushed in reverse so that a fresh pool hands out block 0, 1, 2, ...
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

BlockId BlockPool::allocate() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    KOG_ASSERT(lru_head_ >= 0, "allocate() on an exhausted pool (callers reserve first)");
    b = lru_head_;
    lru_remove(b);
    drop_hash(b);
    ++evictions_;
  }
  ref_[b] = 1;
  parent_[b] = -1;
  return BlockId(b);
}

void BlockPool::release(BlockId block) {
  int32_t b = block.value;
  while (b >= 0) {
    if (--ref_[b] > 0) return;
    const int32_t p = parent_[b];
    parent_[b] = -1;
    if (registered_[b]) {
      lru_push_back(b);
    } else {
      hashed_[b] = 0;
      free_.push_back(b);
    }
    b = p;
  }
}

void BlockPool::revive(BlockId b, BlockId parent) {
  lru_remove(b.value);
  ref_[b.value] = 1;
  parent_[b.value] = parent.value;
}

int32_t BlockPool::evict(int32_t n) {
  int32_t done = 0;
  while (done < n && lru_head_ >= 0) {
    const int32_t b = lru_head_;
    lru_remove(b);
    drop_hash(b);
    free_.push_back(b);
    ++evictions_;
    ++done;
  }
  return done;
}

void BlockPool::seal(BlockId b, BlockHash h, BlockHash parent_h) {
  hash_[b.value] = h;
  parent_hash_[b.value] = parent_h;
  hashed_[b.value] = 1;
  if (map_.emplace(h, b.value).second) registered_[b.value] = 1;
}

void BlockPool::unseal(BlockId b) { drop_hash(b.value); }

BlockId BlockPool::find(BlockHash h, BlockHash parent_h, const int32_t* tokens) const {
  const auto it = map_.find(h);
  if (it == map_.end()) return BlockId();
  const int32_t b = it->second;
  if (parent_hash_[b] != parent_h) return BlockId();
  if (std::memcmp(this->tokens(BlockId(b)), tokens, sizeof(int32_t) * block_size_) != 0)
    return BlockId();
  return BlockId(b);
}

std::vector<int32_t> BlockPool::lru_order() const {
  std::vector<int32_t> out;
  for (int32_t b = lru_head_; b >= 0; b = lru_next_[b]) out.push_back(b);
  return out;
}

void BlockPool::lru_push_back(int32_t b) {
  lru_prev_[b] = lru_tail_;
  lru_next_[b] = -1;
  if (lru_tail_ >= 0) lru_next_[lru_tail_] = b; else lru_head_ = b;
  lru_tail_ = b;
  ++num_cached_;
}

void BlockPool::lru_remove(int32_t b) {
  const int32_t p = lru_prev_[b], n = lru_next_[b];
  if (p >= 0) lru_next_[p] = n; else lru_head_ = n;
  if (n >= 0) lru_prev_[n] = p; else lru_tail_ = p;
  lru_prev_[b] = lru_next_[b] = -1;
  --num_cached_;
}

void BlockPool::drop_hash(int32_t b) {
  if (registered_[b]) {
    map_.erase(hash_[b]);
    registered_[b] = 0;
  }
  hashed_[b] = 0;
}

}  // namespace kog::kv
