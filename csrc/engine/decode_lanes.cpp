// Laneformer lanes in the CPU decode executor: lane LINEARs as one matrix per (segment, lane),
// and the LANE_* ops. Contract: schedule/opcodes.h, schedule/program.h.
//
// A lane-wide buffer row is [n_lanes, hidden]; LANE_HIST row b is [lane_hist_slots, n_lanes,
// hidden]. Every op accumulates in f32 and rounds to the run dtype where the reference model
// (transformers' LaneformerTP, in the run dtype) rounds: once per tensor operation.
#include <cmath>
#include <vector>

#include "common/errors.h"
#include "engine/decode_executor.h"
#include "engine/scalar_dtype.h"

namespace kog::engine {

int64_t DecodeExecutor::lane_matrices(const Op& op) const {
  int64_t seg[3];
  return int64_t(schedule::lane_segments(d_, op.out, seg)) * op.lanes;
}

LinearParams DecodeExecutor::lane_matrix(const Op& op, int64_t batch, int64_t i) {
  int64_t seg[3];
  schedule::lane_segments(d_, op.out, seg);
  const int64_t L = op.lanes, s = i / L, l = i % L, kx = width(Buffer(op.in)) / L;
  int64_t row0 = 0;  // first output row of segment s
  for (int64_t j = 0; j < s; ++j) row0 += seg[j];
  const int64_t rows = seg[s] / L;
  row0 += l * rows;
  LinearParams p = linear_params(op, batch);
  p.out = buf(op.out) + row0 * elem_;
  p.x = buf(op.in) + l * kx * elem_;
  p.weight = static_cast<const char*>(op.w0) + row0 * kx * elem_;
  p.bias = op.w1 ? static_cast<const char*>(op.w1) + row0 * elem_ : nullptr;
  p.n = rows;
  p.k = kx;  // x_stride and out_stride stay the buffers' widths
  return p;
}

void DecodeExecutor::lane_op(const Op& op, int64_t batch) {
  const int64_t L = d_.n_lanes, h = d_.hidden, lw = L * h;
  const DType dt = d_.dtype;
  char* in = buf(op.in);
  const auto opcode = Opcode(op.op);
  if (opcode == Opcode::kLaneGather) {  // slot `slot` of every row's history = the row's lanes
    const int64_t hist_w = width(Buffer::kLaneHist);
    for (int64_t b = 0; b < batch; ++b)
      std::memcpy(buf(op.out) + (b * hist_w + op.slot * lw) * elem_, in + b * lw * elem_, size_t(lw * elem_));
    return;
  }
  std::vector<float> acc(static_cast<size_t>(h));
  for (int64_t b = 0; b < batch; ++b) {
    char* row = in + b * lw * elem_;
    switch (opcode) {
      case Opcode::kLaneScale: {
        const float scale = std::sqrt(float(L));
        for (int64_t e = 0; e < lw; ++e) store_f32(row, e, load_f32(row, e, dt) * scale, dt);
        break;
      }
      case Opcode::kLaneSum: {  // sum rounded once, then written to every lane
        for (int64_t e = 0; e < h; ++e) {
          float s = 0.f;
          for (int64_t l = 0; l < L; ++l) s += load_f32(row, l * h + e, dt);
          acc[size_t(e)] = round_to(s, dt);
        }
        for (int64_t l = 0; l < L; ++l)
          for (int64_t e = 0; e < h; ++e) store_f32(row, l * h + e, acc[size_t(e)], dt);
        break;
      }
      case Opcode::kLaneAddPast: {  // a_l + (round(sum past) - past_l), each step rounded
        const char* past = buf(int32_t(Buffer::kLaneHist)) + (b * width(Buffer::kLaneHist) + op.slot * lw) * elem_;
        for (int64_t e = 0; e < h; ++e) {
          float s = 0.f;
          for (int64_t l = 0; l < L; ++l) s += load_f32(past, l * h + e, dt);
          acc[size_t(e)] = round_to(s, dt);
        }
        for (int64_t l = 0; l < L; ++l)
          for (int64_t e = 0; e < h; ++e) {
            const float others = round_to(acc[size_t(e)] - load_f32(past, l * h + e, dt), dt);
            store_f32(row, l * h + e, load_f32(row, l * h + e, dt) + others, dt);
          }
        break;
      }
      case Opcode::kLaneMean:
      case Opcode::kLaneMergeSum: {
        // MEAN: mean over lanes of in. MERGE_SUM: sum over lanes of round(residual_l + in_l).
        const char* res = op.residual >= 0 ? buf(op.residual) + b * lw * elem_ : nullptr;
        char* out = buf(op.out) + b * h * elem_;
        for (int64_t e = 0; e < h; ++e) {
          float s = 0.f;
          for (int64_t l = 0; l < L; ++l) {
            const float x = load_f32(row, l * h + e, dt);
            s += res ? round_to(load_f32(res, l * h + e, dt) + x, dt) : x;
          }
          store_f32(out, e, opcode == Opcode::kLaneMean ? s / float(L) : s, dt);
        }
        break;
      }
      default: KOG_ASSERT(false, "lane_op: opcode ", op.op, " is not a lane op");
    }
  }
}

}  // namespace kog::engine
