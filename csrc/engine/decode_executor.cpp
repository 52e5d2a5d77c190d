// CPU decode executor. Contract: decode_executor.h.
#include "engine/decode_executor.h"

#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"
#include "engine/scalar_dtype.h"

namespace kog::engine {

DecodeExecutor::DecodeExecutor(const ModelDims& dims, const KVCacheDesc& kv,
                               std::vector<float> inv_freq, std::vector<Op> program)
    : d_(dims), kv_(kv), inv_freq_(std::move(inv_freq)), program_(std::move(program)) {
  schedule::validate_dims(d_);
  KOG_CHECK(int64_t(inv_freq_.size()) * 2 == d_.rotary_dim, "decode executor: rotary_dim ", d_.rotary_dim,
            " != 2 x len(inv_freq) ", inv_freq_.size());
  KOG_CHECK(kv_.base != nullptr && kv_.num_blocks > 0 && kv_.block_size > 0, "decode executor: bad KV cache");
  KOG_CHECK(kv_.dtype == d_.dtype || (d_.dtype == DType::kF32 && is_float_dtype(kv_.dtype)),
            "decode executor: a KV cache of another dtype than the activations' must be f16 or bf16 under f32 "
            "activations");
  schedule::validate_program(program_, d_);
  for (size_t i = 0; i < program_.size(); ++i)  // kog.fp8 / kog.int4: the CPU reads GGUF blocks or dequantized values
    KOG_CHECK(!schedule::is_gpu_weight_format(program_[i].w_type), "decode executor: op ", i,
              " reads a weight in a GPU format (FP8 or 4-bit groups), which only the GPU kernel runs");
  elem_ = dtype_size(d_.dtype);
  qkv_width_ = width(Buffer::kQkv);
  layer_stride_ = kv_.num_blocks * 2 * d_.n_kv_heads * kv_.block_size * d_.head_dim;
  kv_elem_ = dtype_size(kv_.dtype);
  plan_barriers();
  // Row-queue epochs: one per matrix a step splits over the team (a lane LINEAR is one matrix
  // per lane and output segment), unique within the step.
  op_epoch_.resize(program_.size());
  program_epochs_ = 0;
  for (size_t j = 0; j < program_.size(); ++j) {
    op_epoch_[j] = program_epochs_;
    program_epochs_ += program_[j].lanes > 1 ? uint32_t(lane_matrices(program_[j])) : 1u;
  }
}

// NOTE (invariant): inside a step's parallel region an op runs either on thread 0 alone
// (serial: every op but LINEAR) or split over the whole team (LINEAR: which output rows a
// thread computes is decided at run time by the row queue's stealing, so no two split ops share
// a row partition). Program order on thread 0 orders two serial ops; a team barrier orders
// everything before it (transitively: all of it completed) against everything after it. So op j
// needs a barrier before it iff one of its deps ran since the last barrier and the pair is not
// serial -> serial. Two split ops with no dependency may overlap: their row-queue epochs differ
// (a thief skips slices of another epoch) and each thread uses its own scratch slice in turn.
void DecodeExecutor::plan_barriers() {
  barrier_before_.assign(program_.size(), 0);
  auto split = [&](size_t i) {
    const Opcode o = Opcode(program_[i].op);
    return o == Opcode::kLinear || o == Opcode::kRouter || o == Opcode::kMoeExperts;
  };
  size_t since = 0;  // ops [since, j) ran after the last barrier
  for (size_t j = 0; j < program_.size(); ++j) {
    const Op& op = program_[j];
    for (int k = 0; k < op.n_deps; ++k) {
      const size_t d = size_t(op.deps[k]);
      if (d >= since && (split(d) || split(j))) {
        barrier_before_[j] = 1;
        since = j;
        break;
      }
    }
  }
}

int64_t DecodeExecutor::num_barriers() const {
  int64_t n = 0;
  for (char b : barrier_before_) n += b;
  return n;
}

void DecodeExecutor::reserve(int64_t batch) {
  if (batch <= capacity_) return;
  // Each buffer starts on a 64-byte line; TOKENS holds int32 ids, the rest the run dtype.
  int64_t offsets[int(Buffer::kNumBuffers)], total = 0, max_k = 0;
  for (int b = 0; b < int(Buffer::kNumBuffers); ++b) {
    offsets[b] = total;
    total += (batch * width(Buffer(b)) * schedule::buffer_elem_size(d_, b) + 63) / 64 * 64;
    if (b != int(Buffer::kTokens) && b != int(Buffer::kLogits)) max_k = std::max(max_k, width(Buffer(b)));
  }
  max_k = std::max(max_k, d_.expert_intermediate);  // an expert's down projection reads its act rows
  if (d_.n_experts > 0) {
    // router logits [B, E + 1], then x, gu, act, y for the B * K (row, slot) pairs (experts_part)
    const int64_t pairs = batch * (d_.top_k + d_.shared_slots);
    moe_rows_.assign(size_t((batch * (d_.n_experts + 1) + pairs * (2 * d_.hidden + 3 * d_.expert_intermediate)) * elem_), 0);
    moe_acc_.assign(size_t(batch * d_.hidden), 0.f);
    moe_order_.assign(size_t(batch * (d_.top_k + d_.shared_slots)), 0);
  }
  arena_.assign(size_t(total + 64), 0);
  char* aligned = arena_.data() + (64 - reinterpret_cast<uintptr_t>(arena_.data()) % 64) % 64;
  for (int b = 0; b < int(Buffer::kNumBuffers); ++b) base_[b] = aligned + offsets[b];
  scratch_stride_ = batch * max_k;
  scratch_.assign(size_t(cpu::ThreadPool::instance().size() * scratch_stride_), 0.f);
  capacity_ = batch;
}

void DecodeExecutor::validate(const DecodeStep& s) const {
  KOG_CHECK(s.batch >= 1, "decode: batch must be >= 1, got ", s.batch);
  KOG_CHECK(s.tokens && s.positions && s.block_tables && s.seq_lens && s.slots && (s.logits || s.argmax_only),
            "decode: null input");
  KOG_CHECK(!s.argmax_only || s.sampled, "decode: an argmax_only step needs sampled (it writes no logits)");
  // argmax_gather exchanges ids as f32 (exact below 2^24).
  KOG_CHECK(!s.argmax_only || d_.vocab < (int64_t(1) << 24), "decode: argmax_only over a vocabulary of ", d_.vocab,
            " (at most 2^24 ids)");
  KOG_CHECK(s.max_blocks >= 1, "decode: block_tables has no column");
  const int64_t bs = kv_.block_size;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t tok = s.tokens[b], pos = s.positions[b], len = s.seq_lens[b];
    KOG_CHECK(tok >= 0 && tok < d_.vocab, "decode: tokens[", b, "] = ", tok, " is outside the vocabulary of ", d_.vocab);
    KOG_CHECK(pos >= 0 && len == pos + 1, "decode: seq_lens[", b, "] = ", len, " must be positions[", b, "] + 1 = ", pos + 1);
    KOG_CHECK(len <= s.max_blocks * bs, "decode: sequence ", b, " has ", len,
              " tokens but its block table holds ", s.max_blocks * bs);
    const int32_t* row = s.block_tables + b * s.max_blocks;
    for (int64_t i = 0; i < (len + bs - 1) / bs; ++i)
      KOG_CHECK(row[i] >= 0 && row[i] < kv_.num_blocks, "decode: block_tables[", b, ", ", i, "] = ",
                row[i], " is not a block of the cache (", kv_.num_blocks, " blocks)");
    const int64_t want = int64_t(row[pos / bs]) * bs + pos % bs;
    KOG_CHECK(s.slots[b] == want, "decode: slots[", b, "] = ", s.slots[b],
              " is not the slot of position ", pos, " in its block table (", want, ")");
  }
}

void DecodeExecutor::set_transport(std::shared_ptr<ShmTransport> t) {
  std::lock_guard<std::mutex> lock(mu_);
  KOG_CHECK(t == nullptr || (t->size() == d_.lane_ranks && t->rank() == d_.lane_rank), "decode executor: a transport of rank ",
            t ? t->rank() : -1, " of ", t ? t->size() : 0, " for a program of rank ", d_.lane_rank, " of ", d_.lane_ranks);
  transport_ = std::move(t);
  plan_zero_copy();
}

void DecodeExecutor::plan_zero_copy() {
  const size_t n = program_.size();
  publish_slot_.assign(n, -1), read_slot_.assign(n, -1), prefetch_slot_.assign(n, -1);
  if (transport_ == nullptr || d_.lane_ranks == 1) return;
  // LINEAR j - 1 -> LANE_GATHER j -> an in-place lane op j + 1 that rewrites every element of
  // the gathered buffer (what kog.program.lanes emits): only the gather reads the LINEAR's output
  // before j + 1 replaces it, so both may read it from the slot part.
  for (size_t j = 1; j + 1 < n; ++j) {
    const Op& g = program_[j];
    const Op &prod = program_[j - 1], &next = program_[j + 1];
    const Opcode after = Opcode(next.op);
    if (Opcode(g.op) != Opcode::kLaneGather || Opcode(prod.op) != Opcode::kLinear || prod.out != g.in ||
        next.in != g.in || next.out != g.in ||
        (after != Opcode::kLaneAddPast && after != Opcode::kLaneScale && after != Opcode::kLaneSum))
      continue;
    publish_slot_[j - 1] = read_slot_[j] = read_slot_[j + 1] = g.slot;
    // its wait: before the LINEAR (the lines then travel under it) and again before the publish
    // (the LINEAR's weight stream may have evicted them from the core's own caches)
    if (after == Opcode::kLaneAddPast) prefetch_slot_[j - 1] = prefetch_slot_[j] = next.slot;
  }
}

int64_t DecodeExecutor::num_zero_copy_publishes() const {
  int64_t n = 0;
  for (int32_t s : publish_slot_) n += s >= 0;
  return n;
}

char* DecodeExecutor::out_of(const Op& op) const {
  const size_t j = size_t(&op - program_.data());
  if (zero_copy_ && j < publish_slot_.size() && publish_slot_[j] >= 0) return transport_->slot_part(publish_slot_[j]);
  return buf(op.out);
}

const char* DecodeExecutor::in_of(const Op& op) const {
  const size_t j = size_t(&op - program_.data());
  if (zero_copy_ && j < read_slot_.size() && read_slot_[j] >= 0) return transport_->slot_part(read_slot_[j]);
  return buf(op.in);
}

void DecodeExecutor::run(const DecodeStep& s, int64_t stop_after) {
  std::lock_guard<std::mutex> lock(mu_);
  KOG_CHECK(d_.lane_ranks == 1 || transport_ != nullptr, "decode: rank ", d_.lane_rank, " of ", d_.lane_ranks,
            " has no transport (set_transport)");
  validate(s);
  reserve(s.batch);
  batch_ = s.batch;
  argmax_ready_ = false;
  max_seq_len_ = 0;
  for (int64_t b = 0; b < s.batch; ++b) max_seq_len_ = std::max<int64_t>(max_seq_len_, s.seq_lens[b]);
  int32_t* tokens = reinterpret_cast<int32_t*>(buf(int(Buffer::kTokens)));
  for (int64_t b = 0; b < s.batch; ++b) tokens[b] = int32_t(s.tokens[b]);
  const int64_t n = stop_after < 0 ? int64_t(program_.size()) : std::min<int64_t>(stop_after, program_.size());
  const int64_t publish_bytes = s.batch * width(Buffer::kHidden) * elem_;
  // NOTE: not in a partial run (stop_after, for inspection): read_buffer must see every output
  // in its buffer, and a zero-copy LINEAR's lives in the slot until the lane op after it.
  zero_copy_ = transport_ != nullptr && d_.lane_ranks > 1 && publish_bytes <= transport_->slot_bytes() &&
               stop_after < 0;
  // NOTE: the step runs inside one parallel region per segment (the CPU analogue of the
  // persistent GPU kernel): every LINEAR is split over the threads in row chunks (each thread
  // its own slice first, then stealing: cpu/row_queue.h), the small ops run on thread 0 (as
  // plain loops: for_each_row opens no nested region), and the team meets at a barrier only
  // before the ops plan_barriers marked (a dependency that crosses threads). Only attention
  // with enough work for all threads leaves the region, to use the attention kernel's own split
  // (runs_alone); leaving and entering a region orders everything, like a barrier.
  cpu::ThreadPool& pool = cpu::ThreadPool::instance();
  const int n_threads = std::min<int64_t>(pool.size(), int64_t(scratch_.size()) / std::max<int64_t>(1, scratch_stride_));
  // reserve() sized the scratch for the pool's threads at the time, at least one.
  KOG_ASSERT(n_threads >= 1, "decode executor: linear scratch for ", n_threads, " threads");
  for (int64_t i = 0; i < n;) {
    if (runs_alone(program_[i])) {
      exec(program_[i], s);
      ++i;
      continue;
    }
    int64_t end = i;
    while (end < n && !runs_alone(program_[end])) ++end;
    pool.run(n_threads, [&](int t, int nt) {
      if (t == 0 && (!row_queue_ || row_queue_->n_threads() != nt)) row_queue_ = std::make_unique<cpu::RowQueue>(nt);
      pool.barrier();
      for (int64_t j = i; j < end; ++j) {
        if (j > i && barrier_before_[size_t(j)]) pool.barrier();
        const Op& op = program_[size_t(j)];
        if (t == 0 && zero_copy_ && prefetch_slot_[size_t(j)] >= 0) transport_->prefetch(prefetch_slot_[size_t(j)], publish_bytes);
        if (Opcode(op.op) == Opcode::kLinear) {
          linear_part(op, s.batch, epoch_base_ + op_epoch_[size_t(j)], t);
        } else if (Opcode(op.op) == Opcode::kRouter) {
          route_part(op, s.batch, epoch_base_ + op_epoch_[size_t(j)], t);
        } else if (Opcode(op.op) == Opcode::kMoeExperts) {
          experts_part(op, s.batch, t, nt);
        } else if (t == 0) {
          exec(op, s);
        }
      }
    });
    i = end;
  }
  epoch_base_ += program_epochs_ + moe_epochs_;
  moe_epochs_ = 0;
}

// NOTE: attention leaves the region exactly when the kernel would use all threads itself
// (inside the region it runs on thread 0 while the others wait at the barrier): from ~450
// cached tokens for SmolLM2 (9 heads x 64), ~64 for Llama-3-8B (32 x 128).
// The MoE ops stay in it (decode_moe.cpp).
bool DecodeExecutor::runs_alone(const Op& op) const {
  return Opcode(op.op) == Opcode::kAttnDecode &&
         batch_ * max_seq_len_ * d_.n_q_heads * d_.head_dim >= kCpuAttentionParallelMinWork;
}

void DecodeExecutor::exec(const Op& op, const DecodeStep& s) {
  const cpu::KernelTable& k = cpu::kernels();
  const int64_t B = s.batch, hd = d_.head_dim, q_w = d_.n_q_heads * hd, kv_w = d_.n_kv_heads * hd;
  char* qkv = buf(int(Buffer::kQkv));
  switch (Opcode(op.op)) {
    case Opcode::kEmbed: embed(op, s); break;
    case Opcode::kRmsNorm: rmsnorm(op, B); break;
    case Opcode::kLinear: {  // outside a region: the kernel's own threads
      if (op.w_type != schedule::kWeightRunDtype) {
        k.linear_quant(linear_quant_params(op, B, scratch_.data()));
        break;
      }
      if (op.lanes > 1) {
        for (int64_t i = 0; i < lane_matrices(op); ++i) k.linear(lane_matrix(op, B, i), scratch_.data());
        break;
      }
      const LinearParams p = linear_params(op, B);
      k.linear(p, scratch_.data());
      break;
    }
    case Opcode::kQkNorm: qk_norm(op, B); break;
    case Opcode::kRope: {
      RopeParams p{qkv, qkv + q_w * elem_, s.positions, inv_freq_.data(), B, d_.n_q_heads,
                   d_.n_kv_heads, hd, d_.rotary_dim, qkv_width_, qkv_width_, 1.0f, d_.rope_neox,
                   d_.dtype, DType::kI64};
      k.rope(p);
      break;
    }
    case Opcode::kKvAppend: {
      KVAppendParams p{static_cast<char*>(kv_.base) + op.layer * layer_stride_ * kv_elem_,
                       qkv + q_w * elem_, qkv + (q_w + kv_w) * elem_, s.slots, B, d_.n_kv_heads,
                       hd, kv_.block_size, kv_.num_blocks, qkv_width_, qkv_width_, d_.dtype, kv_.dtype};
      k.kv_append(p);
      break;
    }
    case Opcode::kAttnDecode: attention(op, s); break;
    case Opcode::kSiluMul: {
      SiluAndMulParams p{buf(op.out), buf(op.in), B, d_.intermediate, 2 * d_.intermediate,
                         d_.intermediate, d_.dtype};
      k.silu_and_mul(p);
      break;
    }
    case Opcode::kSample: sample(op, s); break;
    case Opcode::kLaneScale:
    case Opcode::kLaneSum:
    case Opcode::kLaneGather:
    case Opcode::kLaneAddPast:
    case Opcode::kLaneMean:
    case Opcode::kLaneMergeSum:
    case Opcode::kAllReduce: lane_op(op, B); break;
    case Opcode::kAllGather:
      if (s.argmax_only && Buffer(op.in) == Buffer::kLogits) {
        argmax_gather(op, B);
      } else {
        lane_op(op, B);
      }
      break;
    default: break;
  }
}

void DecodeExecutor::embed(const Op& op, const DecodeStep& s) {
  const int64_t row = d_.hidden * elem_;
  const int32_t* tokens = reinterpret_cast<const int32_t*>(buf(int(Buffer::kTokens)));
  if (op.w_type != schedule::kWeightRunDtype) {  // f32 run (validate_program): one row dequantized per token
    KOG_ASSERT(width(Buffer(op.out)) == d_.hidden, "decode: a quantized embedding into lanes");
    for (int64_t b = 0; b < s.batch; ++b) {
      const int64_t id = tokens[b];
      cpu::kernels().dequantize_rows({reinterpret_cast<float*>(buf(op.out) + b * row),
                                      static_cast<const uint8_t*>(op.w0), &id, 1, d_.hidden, QuantType(op.w_type)});
    }
    return;
  }
  // Every lane of a lane-wide buffer starts from the same embedding (Laneformer).
  const int64_t lanes = width(Buffer(op.out)) / d_.hidden;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t l = 0; l < lanes; ++l)
      std::memcpy(buf(op.out) + (b * lanes + l) * row, static_cast<const char*>(op.w0) + tokens[b] * row, size_t(row));
}

void DecodeExecutor::rmsnorm(const Op& op, int64_t batch) {
  const int64_t w = width(Buffer(op.out));
  char* res = op.residual >= 0 ? buf(op.residual) : nullptr;
  if (w == d_.hidden * d_.n_lanes && d_.n_lanes > 1) {
    // Each lane is normalized on its own: [B L] rows of hidden with one weight, or per lane l
    // the B rows of lane l (stride L hidden) with weight row l.
    const int64_t h = d_.hidden, L = d_.n_lanes;
    if (!d_.lane_norm_weights) {
      cpu::kernels().rmsnorm({buf(op.out), buf(op.in), res, op.w0, batch * L, h, h, h, h, d_.rms_eps, d_.dtype});
      return;
    }
    for (int64_t l = 0; l < L; ++l) {
      const int64_t off = l * h * elem_;
      cpu::kernels().rmsnorm({buf(op.out) + off, buf(op.in) + off, res ? res + off : nullptr,
                              static_cast<const char*>(op.w0) + off, batch, h, w, w, w, d_.rms_eps, d_.dtype});
    }
    return;
  }
  RMSNormParams p{buf(op.out), buf(op.in), res, op.w0, batch, w, w, w, w, d_.rms_eps, d_.dtype};
  cpu::kernels().rmsnorm(p);
}

void DecodeExecutor::qk_norm(const Op& op, int64_t batch) {
  // Per token: q heads are [n_q_heads, head_dim] rows, k heads follow them in the qkv row.
  const int64_t hd = d_.head_dim;
  for (int64_t b = 0; b < batch; ++b) {
    char* q = buf(op.out) + b * qkv_width_ * elem_;
    char* kk = q + d_.n_q_heads * hd * elem_;
    RMSNormParams pq{q, q, nullptr, op.w0, d_.n_q_heads, hd, hd, hd, 0, d_.rms_eps, d_.dtype};
    RMSNormParams pk{kk, kk, nullptr, op.w1, d_.n_kv_heads, hd, hd, hd, 0, d_.rms_eps, d_.dtype};
    cpu::kernels().rmsnorm(pq);
    cpu::kernels().rmsnorm(pk);
  }
}

DecodeExecutor::LinearOut DecodeExecutor::linear_out(const Op& op) const {
  if (op.vocab_slice && op.lanes == 1)  // a rank's vocabulary slice of LOGITS (program.h)
    return {buf(op.out) + schedule::lane_logits_offset(d_) * elem_, d_.vocab / d_.lane_ranks};
  return {out_of(op), width(Buffer(op.out))};
}

LinearParams DecodeExecutor::linear_params(const Op& op, int64_t batch) {
  const int64_t w = width(Buffer(op.out)), kdim = width(Buffer(op.in));
  const LinearOut o = linear_out(op);
  return LinearParams{o.out, buf(op.in), op.w0, op.w1, batch, o.rows, kdim, kdim, w, d_.dtype};
}

LinearQuantParams DecodeExecutor::linear_quant_params(const Op& op, int64_t batch, float* scratch) {
  // f32 run (validate_program), so out is the f32 buffer itself and the bias f32.
  const int64_t w = width(Buffer(op.out)), kdim = width(Buffer(op.in));
  const LinearOut o = linear_out(op);
  LinearQuantParams p{reinterpret_cast<float*>(o.out), buf(op.in), static_cast<const uint8_t*>(op.w0), scratch, batch,
                      o.rows, kdim, kdim, w, d_.dtype, QuantType(op.w_type)};
  p.bias = static_cast<const float*>(op.w1);
  p.x_stages = kQuantXStages;
  return p;
}

void DecodeExecutor::linear_part(const Op& op, int64_t batch, uint32_t epoch, int part) {
  if (op.w_type != schedule::kWeightRunDtype) {
    // The thread's float scratch slice holds its quantized x: 1.5 m k x_stages bytes <= 4 m k.
    cpu::kernels().linear_quant_part(linear_quant_params(op, batch, scratch_.data() + part * scratch_stride_),
                                     *row_queue_, epoch, part);
    return;
  }
  float* scratch = scratch_.data() + part * scratch_stride_;
  if (op.lanes > 1) {  // one matrix per (segment, lane), consecutive epochs, no barrier between them
    for (int64_t i = 0; i < lane_matrices(op); ++i)
      cpu::kernels().linear_part(lane_matrix(op, batch, i), scratch, *row_queue_, epoch + uint32_t(i), part);
    return;
  }
  cpu::kernels().linear_part(linear_params(op, batch), scratch, *row_queue_, epoch, part);
}

void DecodeExecutor::attention(const Op& op, const DecodeStep& s) {
  const int64_t hd = d_.head_dim;
  PagedAttentionParams p{};
  p.out = buf(op.out);
  p.q = buf(op.in);
  p.kv_cache = static_cast<const char*>(kv_.base) + op.layer * layer_stride_ * kv_elem_;
  p.block_tables = s.block_tables;
  p.seq_lens = s.seq_lens;
  p.query_start_loc = nullptr;
  p.n_seqs = s.batch;
  p.n_tokens = s.batch;
  p.n_q_heads = d_.n_q_heads;
  p.n_kv_heads = d_.n_kv_heads;
  p.head_dim = hd;
  p.block_size = kv_.block_size;
  p.num_blocks = kv_.num_blocks;
  p.max_blocks_per_seq = s.max_blocks;
  p.block_tables_stride = s.max_blocks;
  p.q_stride = qkv_width_;
  p.out_stride = d_.n_q_heads * hd;
  p.max_seq_len = max_seq_len_;
  p.max_q_len = 1;
  p.scale = d_.attn_scale;
  p.dtype = d_.dtype;
  p.kv_dtype = kv_.dtype;
  p.window = op.window;
  cpu::kernels().paged_attention_decode(p);
}

void DecodeExecutor::sample(const Op& op, const DecodeStep& s) {
  // Logits leave the run dtype here: [B, vocab] f32 out (unless argmax_only), greedy ids into TOKENS.
  const char* logits = buf(op.in);
  int32_t* tokens = reinterpret_cast<int32_t*>(buf(op.out));
  for (int64_t b = 0; b < s.batch; ++b) {
    const void* row = logits + b * d_.vocab * elem_;
    if (!s.argmax_only) {
      float* out = s.logits + b * d_.vocab;
      for (int64_t v = 0; v < d_.vocab; ++v) out[v] = load_f32(row, v, d_.dtype);
    }
    const int64_t arg = argmax_ready_ ? argmax_[size_t(b)] : argmax_f32(row, 0, d_.vocab, d_.dtype).index;
    tokens[b] = int32_t(arg);
    if (s.sampled != nullptr) s.sampled[b] = arg;
  }
}

void DecodeExecutor::read_buffer(Buffer b, void* dst, int64_t nbytes) const {
  KOG_CHECK(int(b) >= 0 && b < Buffer::kNumBuffers, "read_buffer: bad buffer ", int(b));
  const int64_t esize = schedule::buffer_elem_size(d_, int32_t(b));  // TOKENS, ROUTE: 4-byte words
  KOG_CHECK(nbytes == batch_ * width(b) * esize, "read_buffer: ", nbytes, " bytes asked, buffer holds ",
            batch_ * width(b) * esize);
  std::memcpy(dst, buf(int(b)), size_t(nbytes));
}

}  // namespace kog::engine
