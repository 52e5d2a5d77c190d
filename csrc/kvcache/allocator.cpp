// Sequences: add, append (with copy-on-write), fork, truncate, free. Prefix cache, pins and swap
// live in prefix_swap.cpp.
#include <algorithm>
#include <cstring>
#include <limits>

#include "common/errors.h"
#include "kvcache/allocator.h"

namespace kog::kv {

KVCacheAllocator::KVCacheAllocator(const KVConfig& cfg)
    : bs_(cfg.block_size),
      bytes_per_block_(cfg.bytes_per_block),
      seed_(namespace_seed(cfg.cache_namespace)),
      pool_(cfg.num_blocks, cfg.block_size),
      pin_count_(cfg.num_blocks, 0),
      num_host_(cfg.num_host_blocks),
      host_hashed_(std::max(cfg.num_host_blocks, 0), 0),
      host_hash_(std::max(cfg.num_host_blocks, 0)),
      host_parent_hash_(std::max(cfg.num_host_blocks, 0)) {
  KOG_CHECK(cfg.num_host_blocks >= 0, "num_host_blocks must be >= 0, got ", cfg.num_host_blocks);
  KOG_CHECK(cfg.bytes_per_block >= 0, "bytes_per_block must be >= 0");
  host_tokens_.assign(static_cast<size_t>(num_host_) * bs_, 0);
  for (int32_t b = num_host_ - 1; b >= 0; --b) host_free_.push_back(b);
}

// ---- public API ------------------------------------------------------------------------------

int64_t KVCacheAllocator::add_sequence(SeqId id, const int32_t* tokens, int64_t n, Moves& mv) {
  KOG_CHECK(n >= 0 && (n == 0 || tokens), "add_sequence: bad prompt (n=", n, ")");
  KOG_CHECK_KIND(!contains(id), kInvalidOperation, "add_sequence: sequence ", id.value,
                 " already exists");
  const std::vector<BlockId> chain = match(tokens, n);
  const int64_t cached = static_cast<int64_t>(chain.size()) * bs_;
  // Cached blocks this prompt revives stop being reclaimable: count them as part of the need.
  int64_t revived = 0;
  for (auto it = chain.rbegin(); it != chain.rend() && pool_.ref(*it) == 0; ++it) ++revived;
  std::unordered_set<int32_t> held;
  for (BlockId b : chain) held.insert(b.value);
  const int64_t need = blocks_for(n - cached) + revived;
  reserve(need, mv, &held);  // NOTE: last step that can throw

  ++queries_;
  query_tokens_ += n;
  hit_tokens_ += cached;
  Sequence s;
  s.tail = acquire(chain);
  s.num_tokens = cached;
  s.named = cached;
  s.table_valid = false;
  Sequence& ref = seqs_.emplace(id, std::move(s)).first->second;
  do_append(ref, n - cached, tokens + cached, mv);
  return cached;
}

void KVCacheAllocator::append(SeqId id, int64_t n, const int32_t* tokens, Moves& mv) {
  KOG_CHECK(n >= 0, "append: n_tokens must be >= 0, got ", n);
  Sequence& s = get_running(id, "append");
  reserve(append_need(s, n), mv);
  do_append(s, n, tokens, mv);
}

void KVCacheAllocator::append_batch(const int64_t* ids, const int64_t* counts, int64_t n,
                                    Moves& mv, const int32_t* tokens) {
  std::vector<Sequence*> seqs(n);
  std::unordered_set<int64_t> seen;
  seen.reserve(n);
  int64_t need = 0;
  for (int64_t i = 0; i < n; ++i) {
    KOG_CHECK(counts[i] >= 0, "append_batch: negative count for sequence ", ids[i]);
    KOG_CHECK(seen.insert(ids[i]).second, "append_batch: sequence ", ids[i], " appears twice");
    seqs[i] = &get_running(SeqId(ids[i]), "append_batch");
    need += append_need(*seqs[i], counts[i]);
  }
  reserve(need, mv);  // NOTE: last step that can throw
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    do_append(*seqs[i], counts[i], tokens ? tokens + offset : nullptr, mv);
    offset += counts[i];
  }
}

bool KVCacheAllocator::can_append(SeqId id, int64_t n) const {
  KOG_CHECK(n >= 0, "can_append: n_tokens must be >= 0, got ", n);
  const int64_t need = append_need(get_running(id, "can_append"), n);
  return available_blocks(need) >= need;
}

int64_t KVCacheAllocator::max_appendable(SeqId id) const {
  const Sequence& s = get_running(id, "max_appendable");
  const int64_t avail = available_blocks(std::numeric_limits<int64_t>::max());
  const int64_t off = s.num_tokens % bs_;
  if (off == 0) return avail * bs_;  // the next token opens a new block
  // The tail's free slots come first; a shared tail costs one block for its copy-on-write.
  const bool cow = pool_.ref(s.tail) > 1;
  if (!cow) return (bs_ - off) + avail * bs_;
  return avail >= 1 ? (bs_ - off) + (avail - 1) * bs_ : 0;
}

int64_t KVCacheAllocator::max_appendable_batch(const int64_t* ids, const int64_t* counts,
                                               int64_t n) const {
  std::vector<int64_t> need(n);  // need[i]: blocks of entries 0..i together
  std::unordered_set<int64_t> seen;
  seen.reserve(n);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    KOG_CHECK(counts[i] >= 0, "max_appendable_batch: negative count for sequence ", ids[i]);
    KOG_CHECK(seen.insert(ids[i]).second, "max_appendable_batch: sequence ", ids[i],
              " appears twice");
    total += append_need(get_running(SeqId(ids[i]), "max_appendable_batch"), counts[i]);
    need[i] = total;
  }
  const int64_t avail = available_blocks(total);
  int64_t fit = 0;
  while (fit < n && need[fit] <= avail) ++fit;
  return fit;
}

void KVCacheAllocator::name_tokens(SeqId id, int64_t start, const int32_t* ids, int64_t n) {
  Sequence& s = get_running(id, "name_tokens");
  KOG_CHECK(n >= 0 && (n == 0 || ids), "name_tokens: bad ids (n=", n, ")");
  KOG_CHECK(start >= 0 && start <= s.named, "name_tokens: start ", start,
            " would leave a gap after the ", s.named, " named tokens of sequence ", id.value);
  KOG_CHECK(start + n <= s.num_tokens, "name_tokens: tokens [", start, ", ", start + n,
            ") pass the sequence's ", s.num_tokens, " tokens");
  materialize(s);
  auto stored = [&](int64_t p) -> int32_t& { return pool_.tokens(BlockId(s.table[p / bs_]))[p % bs_]; };
  // A named token, or one in a registered block (shared with a sequence that named it), is fixed.
  for (int64_t p = start; p < start + n; ++p) {
    if (p >= s.named && !pool_.hashed(BlockId(s.table[p / bs_]))) continue;
    KOG_CHECK(stored(p) == ids[p - start], "name_tokens: token ", p, " of sequence ", id.value,
              " is ", stored(p), ", not ", ids[p - start]);
  }
  for (int64_t p = s.named; p < start + n; ++p) stored(p) = ids[p - start];
  s.named = std::max(s.named, start + n);
  // Register the full blocks now named, in chain order, up to a broken chain.
  for (int64_t i = start / bs_; i < s.named / bs_; ++i) {
    const BlockId b(s.table[i]);
    if (!pool_.hashed(b) && !seal(b, i > 0 ? BlockId(s.table[i - 1]) : BlockId())) break;
  }
  refresh_known(s);
}

void KVCacheAllocator::fork(SeqId parent, SeqId child) { fork_batch(&parent.value, &child.value, 1); }

void KVCacheAllocator::fork_batch(const int64_t* parents, const int64_t* children, int64_t n) {
  std::vector<Sequence*> ps(n);
  std::unordered_set<int64_t> seen;
  seen.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    ps[i] = &get(SeqId(parents[i]));
    KOG_CHECK_KIND(ps[i]->state != SeqState::kSwapped, kInvalidOperation, "fork: sequence ",
                   parents[i], " is swapped out; resume it first");
    KOG_CHECK_KIND(!contains(SeqId(children[i])) && seen.insert(children[i]).second,
                   kInvalidOperation, "fork: sequence ", children[i], " already exists");
  }
  for (int64_t i = 0; i < n; ++i) {
    const Sequence& p = *ps[i];
    Sequence c;
    c.tail = p.tail;
    c.num_tokens = p.num_tokens;
    c.named = p.named;
    c.tokens_known = p.tokens_known;
    c.table_valid = false;  // NOTE: O(1) fork: the child's table is rebuilt on first use
    if (c.tail.valid()) pool_.add_ref(c.tail);
    seqs_.emplace(SeqId(children[i]), std::move(c));
  }
}

void KVCacheAllocator::truncate(SeqId id, int64_t n) {
  Sequence& s = get_running(id, "truncate");
  KOG_CHECK(n >= 0 && n <= s.num_tokens, "truncate: n_tokens must be in [0, ", s.num_tokens,
            "], got ", n);
  const int64_t drop = blocks_for(s.num_tokens) - blocks_for(n);
  s.num_tokens = n;
  s.named = std::min(s.named, n);
  if (drop == 0) return refresh_known(s);
  BlockId new_tail = s.tail;
  for (int64_t i = 0; i < drop; ++i) new_tail = pool_.parent(new_tail);
  // The sequence's reference moves from the old tail to the new one; the cascade from the old
  // tail stops at new_tail at the latest because of that extra reference.
  if (new_tail.valid()) pool_.add_ref(new_tail);
  pool_.release(s.tail);
  s.tail = new_tail;
  if (s.table_valid) s.table.resize(s.table.size() - drop);
  refresh_known(s);
}

void KVCacheAllocator::free(SeqId id) { free_batch(&id.value, 1); }

void KVCacheAllocator::free_batch(const int64_t* ids, int64_t n) {
  std::unordered_set<int64_t> seen;
  for (int64_t i = 0; i < n; ++i) {
    get(SeqId(ids[i]));
    KOG_CHECK(seen.insert(ids[i]).second, "free_batch: sequence ", ids[i], " appears twice");
  }
  for (int64_t i = 0; i < n; ++i) {
    auto it = seqs_.find(SeqId(ids[i]));
    Sequence& s = it->second;
    drop_suspended(s);
    for (HostBlockId h : s.host_blocks) host_free_.push_back(h.value);
    if (s.tail.valid()) pool_.release(s.tail);
    seqs_.erase(it);
  }
}

std::vector<int32_t> KVCacheAllocator::block_table(SeqId id) {
  return resident(id, "block_table").table;
}

int64_t KVCacheAllocator::max_table_len(const int64_t* ids, int64_t n) {
  int64_t width = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Sequence& s = get(SeqId(ids[i]));
    KOG_CHECK_KIND(s.state != SeqState::kSwapped, kInvalidOperation, "max_table_len: sequence ",
                   ids[i], " is swapped out");
    // NOTE: a resident sequence's table has exactly one entry per block of its tokens.
    width = std::max(width, blocks_for(s.num_tokens));
  }
  return width;
}

void KVCacheAllocator::fill_block_tables(const int64_t* ids, int64_t n, int32_t* out,
                                         int64_t width) {
  KOG_CHECK(width >= max_table_len(ids, n), "fill_block_tables: width ", width, " < the ",
            max_table_len(ids, n), " blocks of the longest sequence");
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int32_t>& t = resident(SeqId(ids[i]), "fill_block_tables").table;
    int32_t* row = out + i * width;
    std::copy(t.begin(), t.end(), row);
    std::fill(row + t.size(), row + width, 0);
  }
}

// ---- internal helpers ------------------------------------------------------------------------

KVCacheAllocator::Sequence& KVCacheAllocator::get(SeqId id) {
  auto it = seqs_.find(id);
  KOG_CHECK_KIND(it != seqs_.end(), kUnknownSequence, "unknown sequence ", id.value);
  return it->second;
}

const KVCacheAllocator::Sequence& KVCacheAllocator::get(SeqId id) const {
  auto it = seqs_.find(id);
  KOG_CHECK_KIND(it != seqs_.end(), kUnknownSequence, "unknown sequence ", id.value);
  return it->second;
}

KVCacheAllocator::Sequence& KVCacheAllocator::get_running(SeqId id, const char* op) {
  Sequence& s = get(id);
  KOG_CHECK_KIND(s.state == SeqState::kRunning, kInvalidOperation, op, ": sequence ", id.value,
                 s.state == SeqState::kSuspended ? " is suspended" : " is swapped out");
  return s;
}

const KVCacheAllocator::Sequence& KVCacheAllocator::get_running(SeqId id, const char* op) const {
  const Sequence& s = get(id);
  KOG_CHECK_KIND(s.state == SeqState::kRunning, kInvalidOperation, op, ": sequence ", id.value,
                 s.state == SeqState::kSuspended ? " is suspended" : " is swapped out");
  return s;
}

KVCacheAllocator::Sequence& KVCacheAllocator::resident(SeqId id, const char* op) {
  Sequence& s = get(id);
  KOG_CHECK_KIND(s.state != SeqState::kSwapped, kInvalidOperation, op, ": sequence ", id.value,
                 " is swapped out");
  materialize(s);
  return s;
}

int64_t KVCacheAllocator::append_need(const Sequence& s, int64_t n) const {
  if (n == 0) return 0;
  const bool cow = s.num_tokens % bs_ != 0 && pool_.ref(s.tail) > 1;
  return (cow ? 1 : 0) + blocks_for(s.num_tokens + n) - blocks_for(s.num_tokens);
}

void KVCacheAllocator::do_append(Sequence& s, int64_t n, const int32_t* tokens, Moves& mv) {
  if (n == 0) return;
  if (!tokens) s.tokens_known = false;
  const bool extends_named = tokens && s.named == s.num_tokens;
  if (s.num_tokens % bs_ != 0) prepare_tail_write(s, mv);
  int64_t done = 0;
  while (done < n) {
    int32_t off = static_cast<int32_t>(s.num_tokens % bs_);
    if (off == 0) {
      // The sequence's reference on the old tail becomes the new block's parent link.
      const BlockId b = pool_.allocate();
      pool_.link(b, s.tail);
      s.tail = b;
      if (s.table_valid) s.table.push_back(b.value);
    }
    const int32_t take = static_cast<int32_t>(std::min<int64_t>(bs_ - off, n - done));
    const int64_t base = static_cast<int64_t>(s.tail.value) * bs_ + off;
    for (int32_t j = 0; j < take; ++j) mv.slots.push_back(base + j);
    if (tokens) std::memcpy(pool_.tokens(s.tail) + off, tokens + done, sizeof(int32_t) * take);
    s.num_tokens += take;
    if (extends_named) s.named += take;
    done += take;
    if (s.num_tokens % bs_ == 0 && s.tokens_known) seal_tail(s);
  }
}

void KVCacheAllocator::prepare_tail_write(Sequence& s, Moves& mv) {
  const BlockId t = s.tail;
  if (pool_.ref(t) == 1) {
    // NOTE: exclusively ours, but it may still be registered (full before a truncate): it is
    // about to hold other tokens, so it must leave the prefix cache.
    if (pool_.hashed(t)) pool_.unseal(t);
    return;
  }
  const BlockId dst = pool_.allocate();
  const BlockId p = pool_.parent(t);
  if (p.valid()) pool_.add_ref(p);
  pool_.link(dst, p);
  std::memcpy(pool_.tokens(dst), pool_.tokens(t), sizeof(int32_t) * (s.num_tokens % bs_));
  pool_.release(t);  // ref > 1: only drops our reference
  s.tail = dst;
  if (s.table_valid) s.table.back() = dst.value;
  mv.cow.emplace_back(t.value, dst.value);
  ++cow_;
}

void KVCacheAllocator::seal_tail(Sequence& s) {
  if (!seal(s.tail, pool_.parent(s.tail))) s.tokens_known = false;
}

bool KVCacheAllocator::seal(BlockId b, BlockId parent) {
  if (parent.valid() && !pool_.hashed(parent)) return false;
  const BlockHash ph = parent.valid() ? pool_.hash(parent) : seed_;
  pool_.seal(b, chain_hash(ph, pool_.tokens(b), bs_), ph);
  return true;
}

void KVCacheAllocator::refresh_known(Sequence& s) {
  const BlockId last_full = s.num_tokens % bs_ == 0 || !s.tail.valid() ? s.tail : pool_.parent(s.tail);
  s.tokens_known = s.named == s.num_tokens && (!last_full.valid() || pool_.hashed(last_full));
}

void KVCacheAllocator::materialize(Sequence& s) {
  if (s.table_valid) return;
  s.table.clear();
  for (BlockId b = s.tail; b.valid(); b = pool_.parent(b)) s.table.push_back(b.value);
  std::reverse(s.table.begin(), s.table.end());
  s.table_valid = true;
}

void KVCacheAllocator::drop_suspended(Sequence& s) {
  if (s.state == SeqState::kSuspended) suspended_.erase(s.suspend_tick);
}

}  // namespace kog::kv
