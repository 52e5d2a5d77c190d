// KVCacheAllocator: per-sequence block tables over a BlockPool, copy-on-write forks, the global
// prefix cache, pins, suspend/resume and swap to a host pool. Plain C++: it moves no KV bytes,
// it returns the copies (Moves) for the backend to perform.
//
// Error guarantee (strong): every public method validates and plans first, then mutates; a
// throw (kog::Error) leaves the allocator exactly as it was.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvcache/block_pool.h"
#include "kvcache/ids.h"

namespace kog::kv {

struct KVConfig {
  int32_t num_blocks = 0;       // device pool size
  int32_t block_size = 16;      // tokens per block
  int32_t num_host_blocks = 0;  // host swap pool size (0: no swapping)
  std::string cache_namespace;  // seeds the prefix hash chain (e.g. the model id)
  int64_t bytes_per_block = 0;  // KV bytes of one block, all layers (for stats only)
};

// Copies the backend must perform, in this order: swap_out, swap_in, cow, then the new tokens'
// KV writes at `slots`. NOTE: a block freed by a swap-out may be reused in the same call, so the
// device->host copies must run before anything writes to device blocks.
struct Moves {
  std::vector<std::pair<int32_t, int32_t>> swap_out;  // (device block, host block)
  std::vector<std::pair<int32_t, int32_t>> swap_in;   // (host block, device block)
  std::vector<std::pair<int32_t, int32_t>> cow;       // (src device block, dst device block)
  std::vector<int64_t> slots;  // [n new tokens] block_id * block_size + offset, in order
};

enum class SeqState : uint8_t { kRunning = 0, kSuspended = 1, kSwapped = 2 };

struct Stats {
  int32_t num_blocks, blocks_free, blocks_used, blocks_cached, blocks_pinned;
  int32_t num_host_blocks, host_blocks_free, blocks_swapped;
  int64_t num_sequences, prefix_queries, prefix_query_tokens, prefix_hit_tokens;
  int64_t cow_copies, evictions, blocks_swapped_out, blocks_swapped_in;
  int64_t bytes_swapped_out, bytes_swapped_in;
};

struct SeqInfo {
  SeqState state;
  int32_t tail;  // device tail block (the anchor of the resident prefix when swapped), -1 none
  int64_t num_tokens;
  int64_t named;      // leading tokens whose ids the allocator holds
  bool tokens_known;  // every token named and the hash chain intact: full blocks feed the cache
  std::vector<int32_t> host_blocks;  // swapped-out suffix, root first
};

class KVCacheAllocator {
 public:
  explicit KVCacheAllocator(const KVConfig& cfg);

  // ---- public API: sequences -------------------------------------------------------------
  // Creates `seq` from a prompt: shares the longest cached prefix (full blocks), allocates the
  // rest. Returns the number of prompt tokens already cached (their KV need not be computed).
  int64_t add_sequence(SeqId seq, const int32_t* tokens, int64_t n, Moves& mv);
  // Appends n tokens (token ids, or nullptr if unknown: the sequence then stops feeding the
  // prefix cache). May copy-on-write the tail block and swap out suspended sequences.
  void append(SeqId seq, int64_t n, const int32_t* tokens, Moves& mv);
  // Appends counts[i] tokens to each of n distinct running sequences, all-or-nothing (one
  // reservation for the whole batch). tokens: the sum(counts) ids, sequence after sequence, or
  // nullptr (count-only: the sequences stop feeding the prefix cache).
  void append_batch(const int64_t* seqs, const int64_t* counts, int64_t n, Moves& mv,
                    const int32_t* tokens = nullptr);
  // Names tokens [start, start + n) of a running sequence appended count-only (their ids known
  // only after their KV was computed, as in the decode loop): stores the ids and registers every
  // block they complete in the prefix cache, so the sequence feeds it again. start must leave no
  // gap (start <= the sequence's named prefix); ids already named must match. Moves nothing.
  void name_tokens(SeqId seq, int64_t start, const int32_t* ids, int64_t n);
  // The verb pair of append: whether n more tokens fit now (counting free and cached blocks and
  // what swapping suspended sequences would free, exactly as append reserves), and the most
  // tokens that fit. Both throw as append does for an unknown or non-running sequence.
  bool can_append(SeqId seq, int64_t n) const;
  int64_t max_appendable(SeqId seq) const;
  // How many leading entries of a batch append (as append_batch) fit together now.
  int64_t max_appendable_batch(const int64_t* seqs, const int64_t* counts, int64_t n) const;
  // `child` shares every block of `parent`: O(1), no KV bytes copied.
  void fork(SeqId parent, SeqId child);
  void fork_batch(const int64_t* parents, const int64_t* children, int64_t n);
  // Rolls back to the first n tokens, releasing blocks past them.
  void truncate(SeqId seq, int64_t n);
  void free(SeqId seq);
  void free_batch(const int64_t* seqs, int64_t n);
  void suspend(SeqId seq);
  void resume(SeqId seq, Moves& mv);
  void swap_out(SeqId seq, Moves& mv);  // explicit swap of a suspended sequence

  // ---- public API: prefix cache ----------------------------------------------------------
  int64_t lookup(const int32_t* tokens, int64_t n);  // cached prefix length in tokens
  std::pair<PinId, int64_t> pin(const int32_t* tokens, int64_t n);  // (id, tokens pinned)
  void unpin(PinId pin);
  int32_t evict(int32_t n_blocks) { return pool_.evict(n_blocks); }

  // ---- views -----------------------------------------------------------------------------
  std::vector<int32_t> block_table(SeqId seq);
  // Block tables of n resident sequences as one [n, width] row-major int32 matrix, each row
  // padded with 0 past its sequence's blocks. max_table_len gives the width the rows need.
  int64_t max_table_len(const int64_t* seqs, int64_t n);
  void fill_block_tables(const int64_t* seqs, int64_t n, int32_t* out, int64_t width);
  bool contains(SeqId seq) const { return seqs_.count(seq) != 0; }
  SeqInfo info(SeqId seq) const;
  std::vector<int64_t> sequence_ids() const;
  std::vector<std::pair<int64_t, std::vector<int32_t>>> pins() const;
  std::vector<int32_t> host_free_stack() const { return host_free_; }
  Stats stats() const;
  const BlockPool& pool() const { return pool_; }
  int32_t block_size() const { return bs_; }

 private:
  struct Sequence {
    BlockId tail;
    int64_t num_tokens = 0;
    int64_t named = 0;          // leading tokens whose ids are stored (<= num_tokens)
    bool tokens_known = true;   // == (named == num_tokens and every full block hashed)
    SeqState state = SeqState::kRunning;
    uint64_t suspend_tick = 0;
    bool table_valid = true;
    std::vector<int32_t> table;             // cached block table, rebuilt lazily after fork
    std::vector<HostBlockId> host_blocks;   // swapped-out suffix, root first
  };

  // ---- internal helpers ------------------------------------------------------------------
  Sequence& get(SeqId seq);
  const Sequence& get(SeqId seq) const;
  Sequence& get_running(SeqId seq, const char* op);
  const Sequence& get_running(SeqId seq, const char* op) const;
  // Blocks an allocation may take now: free + cached, plus (only when those fall short of
  // `need`) what swapping suspended sequences out would free, oldest first, until `need` is
  // met; those sequences go to `victims` when given. reserve() plans with it, so the
  // can_append verbs count exactly what append would get.
  int64_t available_blocks(int64_t need, const std::unordered_set<int32_t>* held = nullptr,
                           std::vector<SeqId>* victims = nullptr) const;
  Sequence& resident(SeqId seq, const char* op);  // not swapped out; block table materialized
  int64_t blocks_for(int64_t n_tokens) const { return (n_tokens + bs_ - 1) / bs_; }
  int64_t append_need(const Sequence& s, int64_t n) const;
  // Makes `need` blocks allocatable: counts free + cached blocks, then plans swap-outs of
  // suspended sequences (oldest first); throws KVCacheFull before any change if short.
  // `held` are blocks the caller is about to reference (never counted as swappable).
  void reserve(int64_t need, Moves& mv, const std::unordered_set<int32_t>* held = nullptr);
  std::vector<BlockId> exclusive_suffix(const Sequence& s,
                                        const std::unordered_set<int32_t>* held) const;
  // Swaps out exactly exclusive_suffix(s, held): the blocks reserve() counted, never a block the
  // caller is about to reference (swapping those would free them under it).
  void do_swap_out(SeqId id, Sequence& s, Moves& mv, const std::unordered_set<int32_t>* held);
  void do_append(Sequence& s, int64_t n, const int32_t* tokens, Moves& mv);
  void prepare_tail_write(Sequence& s, Moves& mv);
  void seal_tail(Sequence& s);
  // Registers full block b under its parent (invalid: the first block); false, changing nothing,
  // when the parent is not registered (the chain is broken: nothing past it is cacheable).
  bool seal(BlockId b, BlockId parent);
  // tokens_known from named and the last full block (after a truncate or a naming).
  void refresh_known(Sequence& s);
  std::vector<BlockId> match(const int32_t* tokens, int64_t n) const;
  BlockId acquire(const std::vector<BlockId>& chain);  // refs chain.back(), revives as needed
  void materialize(Sequence& s);
  void drop_suspended(Sequence& s);

  int32_t bs_;
  int64_t bytes_per_block_;
  BlockHash seed_;
  BlockPool pool_;
  std::unordered_map<SeqId, Sequence> seqs_;
  std::map<uint64_t, SeqId> suspended_;  // resident suspended sequences, oldest first
  uint64_t tick_ = 0;
  std::unordered_map<PinId, std::vector<BlockId>> pins_;
  std::vector<int32_t> pin_count_;  // per device block
  int32_t pinned_blocks_ = 0;
  int64_t next_pin_ = 0;
  // Host swap pool: a free stack plus a copy of each swapped block's metadata.
  int32_t num_host_;
  std::vector<int32_t> host_free_;
  std::vector<uint8_t> host_hashed_;
  std::vector<BlockHash> host_hash_, host_parent_hash_;
  std::vector<int32_t> host_tokens_;
  int64_t queries_ = 0, query_tokens_ = 0, hit_tokens_ = 0, cow_ = 0;
  int64_t swapped_out_ = 0, swapped_in_ = 0;
};

}  // namespace kog::kv
