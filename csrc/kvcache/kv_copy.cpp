#include "kvcache/kv_copy.h"

#include <cstring>
#include <vector>

#include "common/errors.h"
#include "cpu/thread_pool.h"

namespace kog::kv {

void validate_block_copy(const BlockCopyParams& p) {
  KOG_CHECK(p.num_layers > 0 && p.slab_bytes > 0 && p.n_pairs >= 0, "copy_blocks: bad shape");
  KOG_CHECK(p.n_pairs == 0 || (p.dst && p.src && p.pairs), "copy_blocks: null pointer");
  const bool same = p.dst == p.src;
  std::vector<uint8_t> written(static_cast<size_t>(p.dst_num_blocks), 0);
  for (int64_t i = 0; i < p.n_pairs; ++i) {
    const int32_t s = p.pairs[2 * i], d = p.pairs[2 * i + 1];
    KOG_CHECK(s >= 0 && s < p.src_num_blocks, "copy_blocks: src block ", s, " out of range [0, ",
              p.src_num_blocks, ")");
    KOG_CHECK(d >= 0 && d < p.dst_num_blocks, "copy_blocks: dst block ", d, " out of range [0, ",
              p.dst_num_blocks, ")");
    KOG_CHECK(!written[d], "copy_blocks: dst block ", d, " written twice");
    written[d] = 1;
  }
  if (same) {  // in-place copies must not read a block another pair writes (order-dependent)
    for (int64_t i = 0; i < p.n_pairs; ++i)
      KOG_CHECK(!written[p.pairs[2 * i]], "copy_blocks: block ", p.pairs[2 * i],
                " is both a source and a destination");
  }
}

void copy_blocks_cpu(const BlockCopyParams& p) {
  validate_block_copy(p);
  auto* dst = static_cast<uint8_t*>(p.dst);
  const auto* src = static_cast<const uint8_t*>(p.src);
  const int64_t total = p.num_layers * p.n_pairs;
  // NOTE: one (layer, pair) slab per iteration; slabs are disjoint, so any order is correct.
  cpu::parallel_for(total, total * p.slab_bytes >= (int64_t{1} << 20), [&](int64_t w) {
    const int64_t layer = w / p.n_pairs, i = w % p.n_pairs;
    const int64_t s = p.pairs[2 * i], d = p.pairs[2 * i + 1];
    std::memcpy(dst + (layer * p.dst_num_blocks + d) * p.slab_bytes,
                src + (layer * p.src_num_blocks + s) * p.slab_bytes, p.slab_bytes);
  });
}

}  // namespace kog::kv
