// One element of a run-dtype buffer read as / written from f32, for the executor's scalar
// loops (built for the baseline ISA: no F16C, no vector code).
#pragma once
#include <cstdint>
#include <cstring>

#include "common/dtype.h"

namespace kog::engine {

// p[i] as f32 (exact for every run dtype).
inline float load_f32(const void* p, int64_t i, DType t) {
  if (t == DType::kF32) return static_cast<const float*>(p)[i];
  uint32_t bits;
  if (t == DType::kBF16) {
    bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
  } else {
    // f16 -> f32 by hand
    const uint16_t h = static_cast<const uint16_t*>(p)[i];
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) {
      bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
      bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {
      float f = float(man) * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// p[i] = v rounded once to the run dtype: round to nearest even, as torch's .to(dtype); a NaN
// stays a quiet NaN.
inline void store_f32(void* p, int64_t i, float v, DType t) {
  if (t == DType::kF32) {
    static_cast<float*>(p)[i] = v;
  } else if (t == DType::kF16) {
    static_cast<_Float16*>(p)[i] = _Float16(v);
  } else {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    static_cast<uint16_t*>(p)[i] = uint16_t(nan ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

// v rounded to the run dtype and back: the value an intermediate tensor of the reference holds.
inline float round_to(float v, DType t) {
  if (t == DType::kF32) return v;
  uint16_t h;
  store_f32(&h, 0, v, t);
  return load_f32(&h, 0, t);
}

// The greedy pick over p[lo, hi): the first strictly greatest element (ties keep the lower
// index; NaN never wins). A range of -inf / NaN only gives (-inf, lo).
struct ArgMax {
  float value;
  int64_t index;
};
inline ArgMax argmax_f32(const void* p, int64_t lo, int64_t hi, DType t) {
  ArgMax best{-__builtin_inff(), lo};
  for (int64_t i = lo; i < hi; ++i) {
    const float x = load_f32(p, i, t);
    if (x > best.value) best = {x, i};
  }
  return best;
}

}  // namespace kog::engine
