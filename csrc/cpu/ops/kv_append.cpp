// CPU KV append (reshape_and_cache). Contract: csrc/ops/kv_append.h.
#include "cpu/kernels.h"
#include "cpu/vec.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

template <typename T>
void append_token(const KVAppendParams& p, int64_t t) {
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const int64_t row_bytes = p.head_dim * int64_t(sizeof(T));
  // K of head h: cache[block][0][h][offset]; V: cache[block][1][h][offset].
  T* k_dst = static_cast<T*>(p.kv_cache) + (block * 2 * p.n_kv_heads * p.block_size + offset) * p.head_dim;
  T* v_dst = k_dst + p.n_kv_heads * p.block_size * p.head_dim;
  const T* k_src = static_cast<const T*>(p.k) + t * p.k_stride;
  const T* v_src = static_cast<const T*>(p.v) + t * p.v_stride;
  for (int64_t h = 0; h < p.n_kv_heads; ++h) {
    __builtin_memcpy(k_dst + h * p.block_size * p.head_dim, k_src + h * p.head_dim, row_bytes);
    __builtin_memcpy(v_dst + h * p.block_size * p.head_dim, v_src + h * p.head_dim, row_bytes);
  }
}

}  // namespace

void kv_append(const KVAppendParams& p) {
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_row(p.n_tokens, p.n_tokens * p.n_kv_heads * p.head_dim >= 4 * kParallelMinElems,
                 [&](int64_t t) { append_token<T>(p, t); });
  });
}

}  // namespace kog::cpu::KOG_ISA_NS
