// Laneformer lanes in the persistent decode kernel (schedule/opcodes.h: kLaneScale .. kLaneMergeSum,
// one device: ModelDims::lane_ranks == 1). Layouts: a lane-wide buffer row is [n_lanes, hidden]
// (HIDDEN, RESIDUAL, NORMED), a LANE_HIST row [lane_hist_slots, n_lanes, hidden]; run dtype T.
//
// A lane op's item is (batch row b, chunk of kRowChunk hidden elements) over every lane: the
// cross-lane sums of one element are one thread's, added in lane order in f32 and rounded where
// the CPU executor (engine/decode_lanes.cpp) rounds, so both give the same values. The in-place
// ops read and write each element from the one thread that owns it.
#pragma once
#include "gpu/decode/params.h"
#include "gpu/decode/small_items.cuh"

namespace kog::gpu::decode {

using schedule::Opcode;

// Items per batch row of a lane op: chunks of the hidden width.
__device__ __forceinline__ int64_t lane_op_parts(const PersistentDecodeParams& p) {
  return (p.dims.hidden + kRowChunk - 1) / kRowChunk;
}

// Whether RMS_NORM's output is lane-wide (each lane normalized on its own), as the CPU executor
// decides it.
__device__ __forceinline__ bool lane_wide(const PersistentDecodeParams& p, int64_t width) {
  return p.dims.n_lanes > 1 && width == p.dims.n_lanes * p.dims.hidden;
}

// One lane op (LANE_SCALE, LANE_SUM, LANE_GATHER, LANE_ADD_PAST, LANE_MEAN, LANE_MERGE_SUM) on
// elements [part * kRowChunk, ...) of every lane of batch row b. in: the lane-wide input;
// out: LANE_HIST (GATHER), the hidden-wide output (MEAN, MERGE_SUM), else in; residual:
// MERGE_SUM's lane-wide residual; hist: LANE_HIST (ADD_PAST reads slot `slot`).
template <typename T>
__device__ void lane_op_item(const PersistentDecodeParams& p, const Op& op, T* in, T* out, const T* residual,
                             const T* hist, int b, int part) {
  const int64_t L = p.dims.n_lanes, h = p.dims.hidden, lw = L * h;
  const int64_t hist_w = p.dims.lane_hist_slots * lw;  // one rank: LANE_HIST holds this rank's lanes
  int64_t e0, e1;
  row_chunk(h, part, e0, e1);
  T* row = in + b * lw;
  for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
    switch (op.op) {
      case int32_t(Opcode::kLaneScale): {  // a_l *= sqrt(lanes of every rank)
        const float scale = sqrtf(float(L * p.dims.lane_ranks));
        for (int64_t l = 0; l < L; ++l) store_f32(row + l * h + e, load_f32(row + l * h + e) * scale);
        break;
      }
      case int32_t(Opcode::kLaneSum): {  // every lane = the rounded sum over the lanes
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) sum += load_f32(row + l * h + e);
        for (int64_t l = 0; l < L; ++l) store_f32(row + l * h + e, sum);
        break;
      }
      case int32_t(Opcode::kLaneGather): {  // LANE_HIST slot = every lane, as they are
        T* dst = out + b * hist_w + int64_t(op.slot) * lw;
        for (int64_t l = 0; l < L; ++l) dst[l * h + e] = row[l * h + e];
        break;
      }
      case int32_t(Opcode::kLaneAddPast): {  // a_l += round(round(sum of the kept lanes) - kept_l)
        const T* past = hist + b * hist_w + int64_t(op.slot) * lw;
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) sum += load_f32(past + l * h + e);
        const float all = round_to<T>(sum);
        for (int64_t l = 0; l < L; ++l) {
          const float others = round_to<T>(all - load_f32(past + l * h + e));
          store_f32(row + l * h + e, load_f32(row + l * h + e) + others);
        }
        break;
      }
      case int32_t(Opcode::kLaneMean):  // out = the sum over the lanes / n_lanes
      case int32_t(Opcode::kLaneMergeSum): {  // out = the sum over the lanes of round(residual_l + a_l)
        const T* res = residual != nullptr ? residual + b * lw : nullptr;
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) {
          const float x = load_f32(row + l * h + e);
          sum += res != nullptr ? round_to<T>(load_f32(res + l * h + e) + x) : x;
        }
        store_f32(out + b * h + e, op.op == int32_t(Opcode::kLaneMean) ? sum / float(L) : sum);
        break;
      }
      default: break;
    }
  }
}

}  // namespace kog::gpu::decode
