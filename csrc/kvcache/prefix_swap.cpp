// Prefix cache (match, lookup, pins), suspend/resume and swapping, reservation, stats.
#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "kvcache/allocator.h"

namespace kog::kv {

// ---- public API: prefix cache ----------------------------------------------------------------

int64_t KVCacheAllocator::lookup(const int32_t* tokens, int64_t n) {
  KOG_CHECK(n >= 0 && (n == 0 || tokens), "lookup: bad prompt (n=", n, ")");
  const int64_t hit = static_cast<int64_t>(match(tokens, n).size()) * bs_;
  ++queries_;
  query_tokens_ += n;
  hit_tokens_ += hit;
  return hit;
}

std::pair<PinId, int64_t> KVCacheAllocator::pin(const int32_t* tokens, int64_t n) {
  KOG_CHECK(n >= 0 && (n == 0 || tokens), "pin: bad prompt (n=", n, ")");
  const std::vector<BlockId> chain = match(tokens, n);
  std::vector<BlockId> blocks;
  // acquire() gives the tail its pin reference; every ancestor gets one more below, so each
  // pinned block carries exactly one reference for this pin.
  for (BlockId b = acquire(chain); b.valid(); b = pool_.parent(b)) {
    if (!blocks.empty()) pool_.add_ref(b);
    if (pin_count_[b.value]++ == 0) ++pinned_blocks_;
    blocks.push_back(b);
  }
  const PinId id(next_pin_++);
  pins_.emplace(id, std::move(blocks));
  return {id, static_cast<int64_t>(chain.size()) * bs_};
}

void KVCacheAllocator::unpin(PinId id) {
  auto it = pins_.find(id);
  KOG_CHECK_KIND(it != pins_.end(), kInvalidOperation, "unpin: unknown pin ", id.value);
  for (BlockId b : it->second) {  // tail first: the cascade never drops a block still pinned
    if (--pin_count_[b.value] == 0) --pinned_blocks_;
    pool_.release(b);
  }
  pins_.erase(it);
}

// ---- public API: suspend / resume / swap -----------------------------------------------------

void KVCacheAllocator::suspend(SeqId id) {
  Sequence& s = get_running(id, "suspend");
  s.state = SeqState::kSuspended;
  s.suspend_tick = tick_++;
  suspended_.emplace(s.suspend_tick, id);
}

void KVCacheAllocator::resume(SeqId id, Moves& mv) {
  Sequence& s = get(id);
  KOG_CHECK_KIND(s.state != SeqState::kRunning, kInvalidOperation, "resume: sequence ", id.value,
                 " is running");
  if (s.state == SeqState::kSwapped) {
    reserve(static_cast<int64_t>(s.host_blocks.size()), mv);  // NOTE: last step that can throw
    for (HostBlockId h : s.host_blocks) {
      // The sequence's reference on its anchor (then on each new block) becomes the link.
      const BlockId b = pool_.allocate();
      pool_.link(b, s.tail);
      std::memcpy(pool_.tokens(b), &host_tokens_[static_cast<size_t>(h.value) * bs_],
                  sizeof(int32_t) * bs_);
      if (host_hashed_[h.value]) pool_.seal(b, host_hash_[h.value], host_parent_hash_[h.value]);
      host_free_.push_back(h.value);
      mv.swap_in.emplace_back(h.value, b.value);
      s.tail = b;
    }
    swapped_in_ += static_cast<int64_t>(s.host_blocks.size());
    s.host_blocks.clear();
  } else {
    drop_suspended(s);
  }
  s.state = SeqState::kRunning;
}

void KVCacheAllocator::swap_out(SeqId id, Moves& mv) {
  Sequence& s = get(id);
  KOG_CHECK_KIND(s.state == SeqState::kSuspended, kInvalidOperation, "swap_out: sequence ",
                 id.value, " is not suspended (or already swapped)");
  const int64_t k = static_cast<int64_t>(exclusive_suffix(s, nullptr).size());
  KOG_CHECK_KIND(k <= static_cast<int64_t>(host_free_.size()), kKVCacheFull, "swap_out: ", k,
                 " host blocks needed, ", host_free_.size(), " free");
  do_swap_out(id, s, mv, nullptr);
}

// ---- views -----------------------------------------------------------------------------------

SeqInfo KVCacheAllocator::info(SeqId id) const {
  const Sequence& s = get(id);
  SeqInfo out{s.state, s.tail.value, s.num_tokens, s.named, s.tokens_known, {}};
  for (HostBlockId h : s.host_blocks) out.host_blocks.push_back(h.value);
  return out;
}

std::vector<int64_t> KVCacheAllocator::sequence_ids() const {
  std::vector<int64_t> out;
  for (const auto& kv : seqs_) out.push_back(kv.first.value);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::pair<int64_t, std::vector<int32_t>>> KVCacheAllocator::pins() const {
  std::vector<std::pair<int64_t, std::vector<int32_t>>> out;
  for (const auto& kv : pins_) {
    std::vector<int32_t> blocks;
    for (BlockId b : kv.second) blocks.push_back(b.value);
    out.emplace_back(kv.first.value, std::move(blocks));
  }
  std::sort(out.begin(), out.end());
  return out;
}

Stats KVCacheAllocator::stats() const {
  Stats st{};
  st.num_blocks = pool_.num_blocks();
  st.blocks_free = pool_.num_free();
  st.blocks_used = pool_.num_used();
  st.blocks_cached = pool_.num_cached();
  st.blocks_pinned = pinned_blocks_;
  st.num_host_blocks = num_host_;
  st.host_blocks_free = static_cast<int32_t>(host_free_.size());
  st.blocks_swapped = num_host_ - st.host_blocks_free;
  st.num_sequences = static_cast<int64_t>(seqs_.size());
  st.prefix_queries = queries_;
  st.prefix_query_tokens = query_tokens_;
  st.prefix_hit_tokens = hit_tokens_;
  st.cow_copies = cow_;
  st.evictions = pool_.evictions();
  st.blocks_swapped_out = swapped_out_;
  st.blocks_swapped_in = swapped_in_;
  st.bytes_swapped_out = swapped_out_ * bytes_per_block_;
  st.bytes_swapped_in = swapped_in_ * bytes_per_block_;
  return st;
}

// ---- internal helpers ------------------------------------------------------------------------

std::vector<BlockId> KVCacheAllocator::match(const int32_t* tokens, int64_t n) const {
  std::vector<BlockId> chain;
  BlockHash h = seed_;
  for (int64_t i = 0; i + bs_ <= n; i += bs_) {
    const BlockHash next = chain_hash(h, tokens + i, bs_);
    const BlockId b = pool_.find(next, h, tokens + i);
    if (!b.valid()) break;
    chain.push_back(b);
    h = next;
  }
  return chain;
}

BlockId KVCacheAllocator::acquire(const std::vector<BlockId>& chain) {
  // Walk back from the tail: a cached block (ref 0) has no parent link, so it is revived under
  // the previous block of the chain, which then needs a reference too; a live block already
  // holds a complete chain of equal content, so the walk stops there.
  for (size_t i = chain.size(); i-- > 0;) {
    const BlockId b = chain[i];
    if (pool_.ref(b) > 0) {
      pool_.add_ref(b);
      break;
    }
    pool_.revive(b, i > 0 ? chain[i - 1] : BlockId());
  }
  return chain.empty() ? BlockId() : chain.back();
}

std::vector<BlockId> KVCacheAllocator::exclusive_suffix(
    const Sequence& s, const std::unordered_set<int32_t>* held) const {
  // NOTE: a block with ref 1 on a sequence's chain is referenced only by the sequence (the tail)
  // or by its single child on that chain, so swapping the sequence out frees exactly this run.
  std::vector<BlockId> out;
  for (BlockId b = s.tail; b.valid() && pool_.ref(b) == 1; b = pool_.parent(b)) {
    if (held && held->count(b.value)) break;
    out.push_back(b);
  }
  return out;
}

int64_t KVCacheAllocator::available_blocks(int64_t need, const std::unordered_set<int32_t>* held,
                                           std::vector<SeqId>* victims) const {
  int64_t avail = pool_.num_reclaimable();
  if (avail >= need) return avail;
  int64_t host_avail = static_cast<int64_t>(host_free_.size());
  for (const auto& kv : suspended_) {
    const int64_t k = static_cast<int64_t>(exclusive_suffix(seqs_.at(kv.second), held).size());
    if (k == 0 || k > host_avail) continue;
    if (victims) victims->push_back(kv.second);
    avail += k;
    host_avail -= k;
    if (avail >= need) break;
  }
  return avail;
}

void KVCacheAllocator::reserve(int64_t need, Moves& mv, const std::unordered_set<int32_t>* held) {
  std::vector<SeqId> victims;
  const int64_t avail = available_blocks(need, held, &victims);
  if (avail >= need && victims.empty()) return;
  KOG_CHECK_KIND(avail >= need, kKVCacheFull, "KV cache full: ", need, " blocks needed, ",
                 pool_.num_free(), " free, ", pool_.num_cached(), " cached, ",
                 avail - pool_.num_reclaimable(), " swappable (", host_free_.size(),
                 " host blocks free)");
  for (SeqId v : victims) do_swap_out(v, seqs_.at(v), mv, held);
}

void KVCacheAllocator::do_swap_out(SeqId id, Sequence& s, Moves& mv,
                                   const std::unordered_set<int32_t>* held) {
  std::vector<BlockId> suffix = exclusive_suffix(s, held);
  std::reverse(suffix.begin(), suffix.end());  // root first
  const BlockId old_tail = s.tail;
  if (!suffix.empty()) {
    s.tail = pool_.parent(suffix.front());   // the anchor: the sequence keeps the link's ref
    pool_.link(suffix.front(), BlockId());   // so the release below stops at the suffix
  }
  for (BlockId b : suffix) {
    const int32_t h = host_free_.back();
    host_free_.pop_back();
    std::memcpy(&host_tokens_[static_cast<size_t>(h) * bs_], pool_.tokens(b), sizeof(int32_t) * bs_);
    host_hashed_[h] = pool_.hashed(b) ? 1 : 0;
    host_hash_[h] = pool_.hash(b);
    host_parent_hash_[h] = pool_.parent_hash(b);
    s.host_blocks.push_back(HostBlockId(h));
    mv.swap_out.emplace_back(b.value, h);
  }
  if (!suffix.empty()) pool_.release(old_tail);
  swapped_out_ += static_cast<int64_t>(suffix.size());
  drop_suspended(s);
  s.state = SeqState::kSwapped;
  s.table_valid = false;
  (void)id;
}

}  // namespace kog::kv
