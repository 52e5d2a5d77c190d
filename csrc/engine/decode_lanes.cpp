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
  // A rank's vocabulary-parallel head writes its slice of LOGITS (weights: the slice's rows).
  const int64_t out0 = op.vocab_slice ? schedule::lane_logits_offset(d_) : 0;
  p.out = out_of(op) + (out0 + row0) * elem_;
  p.x = buf(op.in) + l * kx * elem_;
  p.weight = static_cast<const char*>(op.w0) + row0 * kx * elem_;
  p.bias = op.w1 ? static_cast<const char*>(op.w1) + row0 * elem_ : nullptr;
  p.n = rows;
  p.k = kx;  // x_stride and out_stride stay the buffers' widths
  return p;
}

void DecodeExecutor::reduce_ranks(float* acc, int64_t n) {
  if (d_.lane_ranks > 1) transport_->all_reduce(acc, n);
}

void DecodeExecutor::argmax_gather(const Op& op, int64_t batch) {
  // pairs [R, batch, 2] f32: rank r's (best logit, id) of every row at [r]; zero elsewhere, so
  // the all-reduce's sum is each rank's pair exactly (x + 0 = x, -inf + 0 = -inf).
  const int64_t R = d_.lane_ranks, V = d_.vocab, lo = schedule::lane_logits_offset(d_), hi = lo + V / R;
  const char* in = buf(op.in);
  lane_acc_.assign(size_t(R * batch * 2), 0.f);
  for (int64_t b = 0; b < batch; ++b) {
    // A slice of NaN / -inf only gives its first id: rank 0's is 0, as a full argmax's.
    const ArgMax best = argmax_f32(in + b * V * elem_, lo, hi, d_.dtype);
    float* pair = &lane_acc_[size_t((d_.lane_rank * batch + b) * 2)];
    pair[0] = best.value;
    pair[1] = float(best.index);
  }
  reduce_ranks(lane_acc_.data(), R * batch * 2);
  argmax_.resize(size_t(batch));
  for (int64_t b = 0; b < batch; ++b) {
    // Ranks in vocabulary order, a later one only when strictly greater: ties keep the lower id.
    float best = lane_acc_[size_t(b * 2)];
    int64_t arg = int64_t(lane_acc_[size_t(b * 2 + 1)]);
    for (int64_t r = 1; r < R; ++r) {
      const float* pair = &lane_acc_[size_t((r * batch + b) * 2)];
      if (pair[0] > best) best = pair[0], arg = int64_t(pair[1]);
    }
    argmax_[size_t(b)] = arg;
  }
  argmax_ready_ = true;
  ++argmax_gathers_;
}

// NOTE: on a tensor-parallel rank (lane_ranks > 1) every cross-lane sum is this rank's lanes
// summed in f32, then the ranks' partial sums added in rank order (ShmTransport::all_reduce):
// lanes in their global order, as one process sums them. LANE_GATHER publishes the rank's
// lanes to the transport's slot; LANE_ADD_PAST waits for every rank's part of it.
void DecodeExecutor::lane_op(const Op& op, int64_t batch) {
  const int64_t L = d_.n_lanes, R = d_.lane_ranks, h = d_.hidden, lw = L * h;
  const DType dt = d_.dtype;
  char* in = buf(op.in);
  const char* src = in_of(op);  // in, or the slot part a zero-copy LINEAR wrote (plan_zero_copy)
  const auto opcode = Opcode(op.op);
  if (opcode == Opcode::kAllReduce || opcode == Opcode::kAllGather) {
    // In place on LOGITS: a "lane" head's partial products summed; a vocabulary-parallel head's
    // slices gathered as a sum of rows that are zero outside each rank's slice (exact).
    const int64_t V = d_.vocab, lo = schedule::lane_logits_offset(d_), hi = lo + V / R;
    lane_acc_.resize(size_t(batch * V));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t v = 0; v < V; ++v)
        lane_acc_[size_t(b * V + v)] =
            opcode == Opcode::kAllReduce || (v >= lo && v < hi) ? load_f32(in, b * V + v, dt) : 0.f;
    reduce_ranks(lane_acc_.data(), batch * V);
    for (int64_t e = 0; e < batch * V; ++e) store_f32(in, e, lane_acc_[size_t(e)], dt);
    return;
  }
  if (opcode == Opcode::kLaneGather) {
    if (R > 1) {  // the rank's lanes of every row: [batch, L, h], read by the other ranks later
      transport_->publish(op.slot, src, batch * lw * elem_);
      return;
    }
    const int64_t hist_w = width(Buffer::kLaneHist);
    for (int64_t b = 0; b < batch; ++b)
      std::memcpy(buf(op.out) + (b * hist_w + op.slot * lw) * elem_, in + b * lw * elem_, size_t(lw * elem_));
    return;
  }
  if (opcode == Opcode::kLaneScale) {
    const float scale = std::sqrt(float(L * R));
    for (int64_t e = 0; e < batch * lw; ++e) store_f32(in, e, load_f32(src, e, dt) * scale, dt);
    return;
  }
  lane_acc_.resize(size_t(batch * h));
  float* acc = lane_acc_.data();
  if (opcode == Opcode::kLaneAddPast) {  // a_l + (round(sum of every lane's past) - past_l)
    // The kept outputs: R parts of [batch, L, h] from the transport, or this row's slot of LANE_HIST.
    const char* parts = R > 1 ? transport_->wait(op.slot) : nullptr;
    const int64_t part_stride = R > 1 ? transport_->slot_bytes() : 0;
    auto past = [&](int64_t b, int64_t rank, int64_t l) -> const char* {
      if (R > 1) return parts + rank * part_stride + (b * lw + l * h) * elem_;
      return buf(int32_t(Buffer::kLaneHist)) + (b * width(Buffer::kLaneHist) + op.slot * lw + l * h) * elem_;
    };
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t e = 0; e < h; ++e) {
        float sum = 0.f;
        for (int64_t rank = 0; rank < R; ++rank)
          for (int64_t l = 0; l < L; ++l) sum += load_f32(past(b, rank, l), e, dt);
        acc[e] = round_to(sum, dt);
      }
      char* row = in + b * lw * elem_;
      const char* row_src = src + b * lw * elem_;
      for (int64_t l = 0; l < L; ++l) {
        const char* own = past(b, d_.lane_rank, l);
        for (int64_t e = 0; e < h; ++e) {
          const float others = round_to(acc[e] - load_f32(own, e, dt), dt);
          store_f32(row, l * h + e, load_f32(row_src, l * h + e, dt) + others, dt);
        }
      }
    }
    return;
  }
  // LANE_SUM, LANE_MEAN, LANE_MERGE_SUM: acc [batch, h] = the sum over every lane of the row
  // (MERGE_SUM: of round(residual_l + in_l)), then written back rounded once.
  for (int64_t b = 0; b < batch; ++b) {
    const char* row = src + b * lw * elem_;
    const char* res = op.residual >= 0 ? buf(op.residual) + b * lw * elem_ : nullptr;
    for (int64_t e = 0; e < h; ++e) {
      float sum = 0.f;
      for (int64_t l = 0; l < L; ++l) {
        const float x = load_f32(row, l * h + e, dt);
        sum += res ? round_to(load_f32(res, l * h + e, dt) + x, dt) : x;
      }
      acc[b * h + e] = sum;
    }
  }
  reduce_ranks(acc, batch * h);
  for (int64_t b = 0; b < batch; ++b) {
    if (opcode == Opcode::kLaneSum) {  // every lane of the row = the rounded sum
      char* row = in + b * lw * elem_;
      for (int64_t l = 0; l < L; ++l)
        for (int64_t e = 0; e < h; ++e) store_f32(row, l * h + e, round_to(acc[b * h + e], dt), dt);
    } else {
      char* out = buf(op.out) + b * h * elem_;  // MEAN: the sum / every lane's count; MERGE_SUM: the sum
      for (int64_t e = 0; e < h; ++e)
        store_f32(out, e, opcode == Opcode::kLaneMean ? acc[b * h + e] / float(L * R) : acc[b * h + e], dt);
    }
  }
}

}  // namespace kog::engine
