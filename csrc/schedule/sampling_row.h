// Per-sequence sampling parameters as the GPU kernel reads them (one row per sequence in device
// memory). Plain C++: kog._C exports its size and field offsets (SAMPLING_ROW_LAYOUT) and
// kog.models.gpu_decode builds its numpy dtype from them.
#pragma once
#include <cstdint>

namespace kog::schedule {

// temperature <= 0 is greedy (argmax).
struct SamplingRow {
  float temperature;
  int32_t top_k;       // <= 0: off
  float top_p;         // 1: off
  float min_p;         // 0: off
  uint64_t seed;       // draws are a function of (seed, step counter): reproducible
};

}  // namespace kog::schedule
