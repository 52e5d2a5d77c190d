// Rotary position embedding, applied in place to q and k.
// For pair (a, b) of dimension index i in [0, rotary_dim / 2):
//   theta = position * inv_freq[i];  a' = a cos - b sin;  b' = b cos + a sin
// (cos and sin multiplied by attention_scaling). The pair is (i, i + rotary_dim/2) in the
// neox layout (Llama, Qwen, Mistral as HF stores them) and (2i, 2i + 1) in the interleaved
// layout (GPT-J, Meta's original Llama checkpoints). Dimensions >= rotary_dim are untouched.
// Frequency scaling (llama3, linear, ...) is folded into inv_freq on the host (kog.ops.rope_inv_freq).
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace kog {

struct RopeParams {
  void* q;                // [n_tokens, n_q_heads, head_dim] dtype, token stride q_stride, heads contiguous
  void* k;                // [n_tokens, n_kv_heads, head_dim] dtype, token stride k_stride; nullptr = q only
  const void* positions;  // [n_tokens] pos_dtype (i32 or i64), each >= 0
  const float* inv_freq;  // [rotary_dim / 2] f32
  int64_t n_tokens;
  int64_t n_q_heads;
  int64_t n_kv_heads;
  int64_t head_dim;
  int64_t rotary_dim;     // even, <= head_dim
  int64_t q_stride;       // elements between tokens of q
  int64_t k_stride;       // elements between tokens of k
  float attention_scaling;
  bool is_neox;
  DType dtype;            // f32, f16 or bf16
  DType pos_dtype;        // i32 or i64
};

}  // namespace kog
