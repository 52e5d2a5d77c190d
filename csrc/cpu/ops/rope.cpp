// CPU rotary embedding. Contract: csrc/ops/rope.h.
#include "cpu/kernels.h"
#include "cpu/vec.h"

namespace kog::cpu::KOG_ISA_NS {
namespace {

// Largest rotary_dim / 2 handled with stack buffers (head_dim 512).
constexpr int64_t kMaxHalf = 256;

template <typename T>
void rotate_heads(T* base, int64_t n_heads, int64_t head_dim, int64_t half, bool is_neox,
                  const float* cos_v, const float* sin_v) {
  for (int64_t h = 0; h < n_heads; ++h) {
    T* v = base + h * head_dim;
    if (is_neox) {
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_f32(v[i]), b = to_f32(v[i + half]);
        v[i] = from_f32<T>(a * cos_v[i] - b * sin_v[i]);
        v[i + half] = from_f32<T>(b * cos_v[i] + a * sin_v[i]);
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_f32(v[2 * i]), b = to_f32(v[2 * i + 1]);
        v[2 * i] = from_f32<T>(a * cos_v[i] - b * sin_v[i]);
        v[2 * i + 1] = from_f32<T>(b * cos_v[i] + a * sin_v[i]);
      }
    }
  }
}

template <typename T>
void rope_token(const RopeParams& p, int64_t t) {
  const int64_t half = p.rotary_dim / 2;
  const int64_t pos = p.pos_dtype == DType::kI64 ? static_cast<const int64_t*>(p.positions)[t]
                                                 : static_cast<const int32_t*>(p.positions)[t];
  // One cos/sin per (token, frequency), shared by every head of q and k.
  float cos_v[kMaxHalf], sin_v[kMaxHalf];
  for (int64_t i = 0; i < half; ++i) {
    const float theta = float(pos) * p.inv_freq[i];
    cos_v[i] = __builtin_cosf(theta) * p.attention_scaling;
    sin_v[i] = __builtin_sinf(theta) * p.attention_scaling;
  }
  rotate_heads(static_cast<T*>(p.q) + t * p.q_stride, p.n_q_heads, p.head_dim, half, p.is_neox,
               cos_v, sin_v);
  if (p.k != nullptr)
    rotate_heads(static_cast<T*>(p.k) + t * p.k_stride, p.n_kv_heads, p.head_dim, half, p.is_neox,
                 cos_v, sin_v);
}

}  // namespace

void rope(const RopeParams& p) {
  dispatch_float(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t work = p.n_tokens * (p.n_q_heads + p.n_kv_heads) * p.rotary_dim;
    for_each_row(p.n_tokens, work >= kParallelMinElems, [&](int64_t t) { rope_token<T>(p, t); });
  });
}

}  // namespace kog::cpu::KOG_ISA_NS
