// The CPU decode executor's mixture-of-experts ops, ROUTER and MOE_EXPERTS. Contract:
// decode_executor.h (the executor), schedule/opcodes.h (the ops), docs/ARCHITECTURE.md (why the
// routing buffer and the stacked expert weights look the way they do).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"
#include "engine/decode_executor.h"
#include "engine/scalar_dtype.h"

namespace kog::engine {
namespace {

using Scored = std::pair<float, int64_t>;  // (probability, expert id)

// NOTE: the k best of q (filled with (probs[j], j) in id order) in the order torch.topk returns
// them on the CPU, ties included: torch sorts the same pairs with the same standard algorithms --
// a partial sort when k * 64 <= n, else nth_element at k - 1 and a sort of the k - 1 before it --
// under "greater value first, NaN first". Equal probabilities therefore land where those
// algorithms put them (not always the lower id first), and a tied router picks the experts
// transformers picks (tests/cpu/test_moe.py: tied scores).
void topk_like_torch(std::vector<Scored>& q, int64_t k) {
  auto before = [](const Scored& x, const Scored& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
  };
  const auto n = int64_t(q.size());
  if (k * 64 <= n) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), before);
  } else {
    std::nth_element(q.begin(), q.begin() + (k - 1), q.end(), before);
    std::sort(q.begin(), q.begin() + (k - 1), before);
  }
}

// KOG_MOE_MERGE=0 runs each (row, slot) pair as its own GEMM (every row reads its experts'
// matrices itself): the baseline bench/moe_decode.py measures the merged GEMMs against. Read per
// call, so a test can flip it between steps.
bool merge_rows_per_expert() {
  const char* v = std::getenv("KOG_MOE_MERGE");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

}  // namespace

int64_t DecodeExecutor::expert_row_bytes(int32_t w_type, int64_t k) const {
  if (w_type == schedule::kWeightRunDtype) return k * elem_;
  const QuantTypeInfo info = quant_type_info(QuantType(w_type));
  return k / info.elems * info.bytes;
}

// out [m, n] = in [m, k] @ w^T for one expert's matrix w (run dtype, or blocks of w_type: then the
// run dtype is f32 (validate_program) and x is quantized in kQuantXStages int8 stages, as the
// dense quantized LINEAR; the thread's scratch slice holds its quantized x, 3 m k bytes <= 4 m k).
void DecodeExecutor::expert_gemm(const char* w, int32_t w_type, char* out, const char* in, int64_t m, int64_t n,
                                 int64_t k, float* scratch, uint32_t epoch, int t) {
  if (w_type == schedule::kWeightRunDtype) {
    cpu::kernels().linear_part({out, in, w, nullptr, m, n, k, k, n, d_.dtype}, scratch, *row_queue_, epoch, t);
    return;
  }
  LinearQuantParams p{reinterpret_cast<float*>(out), in, reinterpret_cast<const uint8_t*>(w), scratch, m, n, k, k, n,
                      d_.dtype, QuantType(w_type)};
  p.x_stages = kQuantXStages;
  cpu::kernels().linear_quant_part(p, *row_queue_, epoch, t);
}

// route[b] = ids of the top_k experts of softmax(x[b] @ router^T) and their weights (renormalized
// to sum 1 with norm_topk), then the shared slots E.. with weight sigmoid(x[b] @ router[E]). The
// logits are rounded to the run dtype, as the interpreter's GEMM rounds them; the rest in f32.
// As thread t of the step's parallel region: the [B, n] logits GEMM split by the row queue
// (epoch: the op's own), a team barrier, the top-k on thread 0.
void DecodeExecutor::route_part(const Op& op, int64_t batch, uint32_t epoch, int t) {
  const int64_t n = d_.n_experts + (d_.shared_slots > 0);
  const LinearParams p{moe_rows_.data(), buf(op.in), op.w0, nullptr, batch, n, d_.hidden, d_.hidden, n, d_.dtype};
  cpu::kernels().linear_part(p, scratch_.data() + t * scratch_stride_, *row_queue_, epoch, t);
  cpu::ThreadPool::instance().barrier();
  if (t == 0) route(batch);
}

void DecodeExecutor::route(int64_t batch) {
  const int64_t E = d_.n_experts, K = d_.top_k, S = d_.shared_slots, n = E + (S > 0), W = K + S;
  const char* logits = moe_rows_.data();  // [B, n] run dtype
  int32_t* out = reinterpret_cast<int32_t*>(buf(int(Buffer::kRoute)));  // [B, 2W] words: W ids, then W f32 weights
  std::vector<Scored> q(static_cast<size_t>(E));
  for (int64_t b = 0; b < batch; ++b) {
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, load_f32(logits, b * n + e, d_.dtype));
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      q[size_t(e)] = {std::exp(load_f32(logits, b * n + e, d_.dtype) - mx), e};
      sum += q[size_t(e)].first;
    }
    const float inv = 1.f / sum;
    for (Scored& s : q) s.first *= inv;
    // q is in id order again for every row: the order ties are broken from.
    topk_like_torch(q, K);
    float top_sum = 0.f;
    for (int64_t j = 0; j < K; ++j) top_sum += q[size_t(j)].first;
    int32_t* row = out + b * 2 * W;
    for (int64_t j = 0; j < K; ++j) {
      const float w = d_.norm_topk ? q[size_t(j)].first / top_sum : q[size_t(j)].first;
      row[j] = int32_t(q[size_t(j)].second);
      std::memcpy(row + W + j, &w, 4);
    }
    if (S > 0) {
      const float g = 1.f / (1.f + std::exp(-load_f32(logits, b * n + E, d_.dtype)));
      for (int64_t j = K; j < W; ++j) {
        row[j] = int32_t(E + j - K);
        std::memcpy(row + W + j, &g, 4);
      }
    }
  }
}

// out[b] = sum over b's routed experts e of weight(b, e) * down_e(silu(gate_e x[b]) * up_e x[b]),
// as thread t of the step's parallel region (every thread calls it; run() puts a barrier before
// the ops that read out). Phases, a team barrier after each: thread 0 groups the (row, slot) pairs
// by expert (a counting sort, rows ascending in each group) and gathers their x rows; every
// chosen expert's [gate; up] GEMM over its pairs, split over the team by the row queue (one
// epoch per expert, no barrier between experts: their outputs are disjoint); SiLU-mul over a
// slice of the pairs per thread; the down GEMMs the same way; thread 0 adds each pair's row
// into its row's f32 sum in ascending expert order (as the interpreter adds them) and stores out.
// NOTE: rows that chose the same expert run as one GEMM over that expert's weights (each chosen
// expert's matrices are read once per step, however many rows chose it, and an expert no row
// chose is never read), unless KOG_MOE_MERGE=0 (then one GEMM per pair). Quantized stacks
// (op.w_type / op.w1_type a QuantType) are read in their blocks by the quantized GEMV, only the
// chosen experts' rows.
void DecodeExecutor::experts_part(const Op& op, int64_t batch, int t, int nt) {
  // K: slots per row (routed + shared), E: stacked experts (routed + shared slices), P: pairs
  const int64_t E = d_.n_experts + d_.shared_slots, K = d_.top_k + d_.shared_slots, P = batch * K;
  const int64_t H = d_.hidden, I = d_.expert_intermediate;
  const int32_t* route = reinterpret_cast<const int32_t*>(buf(int(Buffer::kRoute)));
  char* x = moe_rows_.data() + batch * (d_.n_experts + 1) * elem_;  // [P, H] pairs' rows of in
  char* gu = x + P * H * elem_;                                        // [P, 2I]
  char* act = gu + P * 2 * I * elem_;                                  // [P, I]
  char* y = act + P * I * elem_;                                       // [P, H]
  cpu::ThreadPool& pool = cpu::ThreadPool::instance();
  // Expert parallelism: pairs routed to another rank's expert are that rank's (dropped here).
  auto mine = [&](int32_t e) { return op.expert_ranks == nullptr || op.expert_ranks[e] == d_.lane_rank; };
  if (t == 0) {
    moe_start_.assign(size_t(E + 1), 0);
    for (int64_t i = 0; i < P; ++i) {
      const int32_t e = route[(i / K) * 2 * K + i % K];
      KOG_ASSERT(e >= 0 && e < E, "moe experts: row ", i / K, " routes to expert ", e, " of ", E);
      if (mine(e)) ++moe_start_[size_t(e) + 1];
    }
    for (int64_t e = 0; e < E; ++e) moe_start_[size_t(e + 1)] += moe_start_[size_t(e)];
    std::vector<int64_t> fill(moe_start_.begin(), moe_start_.end() - 1);
    for (int64_t i = 0; i < P; ++i) {
      const int32_t e = route[(i / K) * 2 * K + i % K];
      if (mine(e)) moe_order_[size_t(fill[size_t(e)]++)] = int32_t(i);
    }
    const char* in = buf(op.in);
    for (int64_t j = 0; j < moe_start_[size_t(E)]; ++j)
      std::memcpy(x + j * H * elem_, in + (moe_order_[size_t(j)] / K) * H * elem_, size_t(H * elem_));
  }
  pool.barrier();
  const int64_t P_mine = moe_start_[size_t(E)];  // this rank's pairs (all of them without a placement)
  const bool merge = merge_rows_per_expert();
  uint32_t epoch = epoch_base_ + program_epochs_ + moe_epochs_;
  float* scratch = scratch_.data() + t * scratch_stride_;
  // One GEMM per group of pairs (an expert's, or one pair when not merging): out rows
  // [first, first + m) = in rows [first, first + m) @ expert e's [n, k] matrix of the stack w,
  // the stack's matrix `local`: with a placement the stacks hold this rank's experts only, in
  // ascending expert order (program.h Op::expert_ranks).
  auto gemms = [&](const void* w, int32_t w_type, char* out, const char* in, int64_t n, int64_t k) {
    const int64_t expert_bytes = n * expert_row_bytes(w_type, k);
    for (int64_t e = 0, local = 0; e < E; ++e) {
      if (!mine(int32_t(e))) continue;
      for (int64_t first = moe_start_[size_t(e)], end = moe_start_[size_t(e + 1)]; first < end;) {
        const int64_t m = merge ? end - first : 1;
        expert_gemm(static_cast<const char*>(w) + local * expert_bytes, w_type, out + first * n * elem_,
                    in + first * k * elem_, m, n, k, scratch, epoch++, t);
        first += m;
      }
      ++local;
    }
  };
  gemms(op.w0, op.w_type, gu, x, 2 * I, H);
  pool.barrier();
  const int64_t lo = P_mine * t / nt, hi = P_mine * (t + 1) / nt;
  if (hi > lo) cpu::kernels().silu_and_mul({act + lo * I * elem_, gu + lo * 2 * I * elem_, hi - lo, I, 2 * I, I, d_.dtype});
  pool.barrier();
  gemms(op.w1, op.w1_type, y, act, H, I);
  pool.barrier();
  if (t != 0) return;
  moe_epochs_ = epoch - (epoch_base_ + program_epochs_);
  std::fill(moe_acc_.begin(), moe_acc_.begin() + batch * H, 0.f);
  for (int64_t j = 0; j < P_mine; ++j) {  // pairs in ascending expert order
    const int64_t pair = moe_order_[size_t(j)], row = pair / K;
    float w;
    std::memcpy(&w, route + row * 2 * K + K + pair % K, 4);
    float* acc = moe_acc_.data() + row * H;
    for (int64_t h = 0; h < H; ++h) acc[h] += w * load_f32(y, j * H + h, d_.dtype);
  }
  char* out = buf(op.out);
  for (int64_t i = 0; i < batch * H; ++i) store_f32(out, i, moe_acc_[size_t(i)], d_.dtype);
}

}  // namespace kog::engine
