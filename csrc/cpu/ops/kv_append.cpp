// CPU KV append (reshape_and_cache). Contract: csrc/ops/kv_append.h.
#include "cpu/kernels.h"
#include "cpu/vec.h"

#include <type_traits>

namespace kog::cpu::KOG_ISA_NS {
namespace {

// One head's row: copied when the types match, else widened to f32 and rounded to C.
template <typename T, typename C>
inline void put_row(C* dst, const T* src, int64_t n) {
  if constexpr (std::is_same_v<T, C>) {
    __builtin_memcpy(dst, src, n * int64_t(sizeof(T)));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<C>(to_f32(src[i]));
  }
}

// k and v of dtype T into a cache of dtype C.
template <typename T, typename C>
void append_token(const KVAppendParams& p, int64_t t) {
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  // K of head h: cache[block][0][h][offset]; V: cache[block][1][h][offset].
  C* k_dst = static_cast<C*>(p.kv_cache) + (block * 2 * p.n_kv_heads * p.block_size + offset) * p.head_dim;
  C* v_dst = k_dst + p.n_kv_heads * p.block_size * p.head_dim;
  const T* k_src = static_cast<const T*>(p.k) + t * p.k_stride;
  const T* v_src = static_cast<const T*>(p.v) + t * p.v_stride;
  for (int64_t h = 0; h < p.n_kv_heads; ++h) {
    put_row(k_dst + h * p.block_size * p.head_dim, k_src + h * p.head_dim, p.head_dim);
    put_row(v_dst + h * p.block_size * p.head_dim, v_src + h * p.head_dim, p.head_dim);
  }
}

}  // namespace

void kv_append(const KVAppendParams& p) {
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_float(p.kv_dtype, [&](auto cache_tag) {
      using C = decltype(cache_tag);
      for_each_row(p.n_tokens, p.n_tokens * p.n_kv_heads * p.head_dim >= 4 * kParallelMinElems,
                   [&](int64_t t) { append_token<T, C>(p, t); });
    });
  });
}

}  // namespace kog::cpu::KOG_ISA_NS
