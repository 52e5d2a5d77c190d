// The persistent decode kernel: ONE launch runs whole decode steps of a batch -- every layer,
// the final norm, the LM head and sampling -- for n_steps tokens (loop mode: the sampled token
// feeds the next step on the device; positions, slots and stop checks too).
//
// Every workgroup walks the same program (the expanded schedule::Op list). Op j of step s is
// split into work items; workgroup w takes items w, w + grid, ... Before its first item of an
// op, a workgroup (1) issues the loads of its first weight vectors when the op is a LINEAR, then
// (2) waits until the completion counter of each of the op's deps reaches that dep's item count
// (exactly its deps, not the op before it: independent ops overlap); after each item it bumps
// the op's own counter (sync.cuh). A dep's full count implies its own deps completed (each item
// ran after them), so waits are transitive. A new step first waits on the previous step's sinks
// (schedule::program_sinks: every op is one of them or an ancestor). So there is no grid-wide
// barrier: a workgroup with nothing to do in an op runs ahead to the next one and has its
// weights in flight while the ops it depends on finish elsewhere. The last workgroup to leave zeroes the counters, so
// nothing is reset or re-captured between launches, whatever the batch or context lengths.
// Cooperative launch guarantees that all workgroups are resident (the waits cannot deadlock).
//
// This header holds the kernel template; persistent_kernel_float.cu and persistent_kernel_quant.cu
// instantiate it (two translation units, so the build compiles them in parallel: each
// instantiation is minutes of ptxas / LLVM), persistent_decode.cu is the host side.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gpu/decode/attention_item.cuh"
#include "gpu/decode/executor.h"
#include "gpu/decode/lane_items.cuh"
#include "gpu/decode/linear_item.cuh"
#include "gpu/decode/moe_items.cuh"
#include "gpu/decode/rank_items.cuh"
#include "gpu/decode/sample_item.cuh"
#include "gpu/decode/small_items.cuh"

namespace kog::gpu::decode {

using schedule::Buffer;
using schedule::Opcode;

static_assert(GpuDecodeExecutor::kMaxBatch == kMaxBatch, "one batch limit");

namespace {

constexpr int kMaxOf(int a, int b) { return a > b ? a : b; }
constexpr int kSmemFloats =
    kMaxOf(kMaxOf(kAttnPartialSmemFloats, kMoeTailSmemFloats), kMaxOf(kSampleSmemFloats, kSampleChunkSmemFloats));

__host__ __device__ __forceinline__ int64_t buffer_width(const PersistentDecodeParams& p, int32_t b) {
  return schedule::buffer_width(p.dims, b);
}

// Weight rows of a GEMV op (schedule::is_gemv): its output width, both halves of a fused
// gate/up, or the router's rows.
// NOTE: values of p are loaded unconditionally and then selected, here and in run_item: a
// conditional load of one of two fields of p becomes a load through a select of their addresses,
// which keeps LLVM (15) from reading p in place -- the whole struct is then copied to scratch
// memory on AMD (616 bytes a lane).
// A tensor-parallel rank's vocabulary-sliced LM head (Op::vocab_slice) has vocab / ranks rows.
__device__ __forceinline__ int64_t gemv_rows(const PersistentDecodeParams& p, const Op& op) {
  const int64_t glu = 2 * p.dims.intermediate, router = schedule::router_rows(p.dims), width = buffer_width(p, op.out);
  const int64_t slice = p.vocab_slice_rows;
  return op.op == kOpLinearSiluMul ? glu : op.op == schedule::kOpRouterGemv ? router : op.vocab_slice ? slice : width;
}

// Length of a GEMV op's weight rows: its input's width, or a lane LINEAR's slice of it
// (GemvLanes: width(in) / lanes). kQuant: a quantized program, which has no lanes
// (expand_gpu_program), so its kernel does not look.
template <bool kQuant>
__device__ __forceinline__ int64_t gemv_k(const PersistentDecodeParams& p, const Op& op) {
  const int64_t w = buffer_width(p, op.in);
  return !kQuant && op.lanes > 1 ? w / op.lanes : w;
}

// Bytes of one weight row of a GEMV op over k inputs: FP8 weights take one byte an element,
// 4-bit ones half a byte (their group affines are read beside the codes, not staged).
template <typename T>
__device__ __forceinline__ int64_t gemv_row_bytes(const Op& op, int64_t k) {
  return op.w_type == schedule::kWeightFp8                                         ? k
         : op.w_type == schedule::kWeightQ4Groups || op.w_type == schedule::kWeightQ4K ? k / 2
                                                                                     : k * int64_t(sizeof(T));
}

// What a GEMV op does with its products, and (rows()) how its items take its weight rows: the
// one mapping from opcode to epilogue, for the GEMV item and its weight staging. kv_layer: the
// op's layer of the cache (kOpLinearRopeKv writes it).
template <typename T>
__device__ __forceinline__ GemvEpilogueArgs<T> gemv_epilogue(const PersistentDecodeParams& p, const Op& op,
                                                             T* kv_layer) {
  GemvEpilogueArgs<T> ep;
  if (op.op == kOpLinearSiluMul) {
    ep.kind = GemvEpilogue::kSiluMul;
  } else if (op.op == kOpLinearRopeKv) {
    ep.kind = GemvEpilogue::kRopeKv;
    ep.n_q = int32_t(p.dims.n_q_heads), ep.n_kv = int32_t(p.dims.n_kv_heads), ep.hd = int32_t(p.dims.head_dim);
    ep.neox = p.dims.rope_neox, ep.inv_freq = p.inv_freq, ep.positions = p.positions, ep.slots = p.slots;
    ep.kv_layer = kv_layer, ep.block_size = p.block_size;
  } else {  // residual >= 0: out is the residual stream, added into (fuse_residual_adds)
    ep.kind = op.residual >= 0 ? GemvEpilogue::kAccumulate : GemvEpilogue::kStore;
  }
  return ep;
}

// Items of a small op per batch row (small_items.cuh); item = b * parts + part.
__device__ inline int64_t parts_per_row(const PersistentDecodeParams& p, const Op& op) {
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  switch (op.op) {
    case int32_t(Opcode::kEmbed): return ceil_div(buffer_width(p, op.out), kRowChunk);
    case int32_t(Opcode::kRmsNorm): {
      const int64_t w = buffer_width(p, op.out);  // lane-wide: n_lanes rows of hidden per batch row
      const int64_t rows = lane_wide(p, w) ? p.dims.n_lanes : 1, row_w = w / rows;
      return rows * (op.residual >= 0 ? 1 : ceil_div(row_w, kRowChunk));
    }
    case int32_t(Opcode::kLaneScale):
    case int32_t(Opcode::kLaneSum):
    case int32_t(Opcode::kLaneGather):
    case int32_t(Opcode::kLaneAddPast):
    case int32_t(Opcode::kLaneMean):
    case int32_t(Opcode::kLaneMergeSum): return lane_op_parts(p);
    case int32_t(Opcode::kAllReduce):  // a tensor-parallel rank's logits push (the finish: items_of)
    case int32_t(Opcode::kAllGather): return logits_push_parts(p, op);
    case int32_t(Opcode::kQkNorm): return ceil_div(p.dims.n_q_heads + p.dims.n_kv_heads, kThreads / KOG_WARP_SIZE);
    case int32_t(Opcode::kRope): return ceil_div(p.dims.n_q_heads + p.dims.n_kv_heads, kRopeHeads);
    case int32_t(Opcode::kKvAppend): return p.dims.n_kv_heads;
    case int32_t(Opcode::kSiluMul): return ceil_div(p.dims.intermediate, kRowChunk);
    case schedule::kOpMoeCombine: return ceil_div(p.dims.hidden, kRowChunk);
    default: return 1;  // SAMPLE: one item per sequence
  }
}

__device__ inline int64_t items_of(const PersistentDecodeParams& p, const Op& op) {
  if (schedule::is_logits_finish(op)) return sample_chunks(p.dims.vocab);  // one item per sample chunk, every row
  switch (op.op) {
    case int32_t(Opcode::kLinear):
    case kOpLinearSamplePartial:
    case kOpLinearSiluMul:  // fused: a pair of rows per warp
    case kOpLinearRopeKv:
    case schedule::kOpRouterGemv:
      return linear_items(gemv_rows(p, op), op.op == kOpLinearSiluMul || op.op == kOpLinearRopeKv);
    case schedule::kOpMoeGateUp: return moe_groups(p) * moe_gate_up_items_per_group(p);
    case schedule::kOpMoeDown: return moe_groups(p) * moe_down_items_per_group(p);
    case int32_t(Opcode::kAttnDecode): return int64_t(p.batch) * p.dims.n_kv_heads * p.max_parts;
    default: return int64_t(p.batch) * parts_per_row(p, op);
  }
}

// st / stage: for a LINEAR, the stage holding the item's first weight vectors (landed).
// The LM head's item tail: the last of a chunk's items to finish writes, for every sequence,
// the chunk's f32 logits output and its summary (SAMPLE's first phase, without an op and a
// grid-wide wait of its own). Item i holds logit rows [i * rows, (i + 1) * rows), rows =
// linear_rows_per_item(), so chunk c's items are [c * per_chunk, (c + 1) * per_chunk).
// chunk_item: item is a whole chunk (a tensor-parallel rank's logits finish, rank_items.cuh):
// no group to wait for.
template <typename T>
__device__ inline void sample_partial_tail(const PersistentDecodeParams& p, const T* logits, int64_t item,
                                           bool chunk_item, float* smem) {
  static_assert(kSampleChunk % (kWarps * kLinearRowsPerWarp) == 0, "a sample chunk is whole LM-head items");
  constexpr int64_t per_chunk = kSampleChunk / (kWarps * kLinearRowsPerWarp);
  const int64_t chunk = chunk_item ? item : item / per_chunk, n_chunks = sample_chunks(p.dims.vocab);
  const int64_t left = linear_items(p.dims.vocab) - chunk * per_chunk, in_chunk = left < per_chunk ? left : per_chunk;
  if (!chunk_item && !last_of_group(p.sample_chunk_counts + chunk, unsigned(in_chunk), smem)) return;
#pragma unroll 1
  for (int b = 0; b < p.batch; ++b) {
    const int64_t s = int64_t(b) * n_chunks + chunk;  // [B, chunks]
    sample_chunk_item<T>(logits + int64_t(b) * p.dims.vocab, p.logits_out + int64_t(b) * p.dims.vocab, p.dims.vocab,
                         chunk, p.sampling[b].temperature, p.sample_summaries + s,
                         p.sample_values + s * kSampleCandidateSlots, p.sample_indices + s * kSampleCandidateSlots,
                         smem);
    __syncthreads();  // the next row reuses smem
  }
}

// kQuant: the program has GEMVs over a GPU weight format (schedule::is_gpu_weight_format: FP8,
// 4-bit groups, Q4_K); only then are those GEMVs compiled in, so a float model's kernel is the
// float GEMV's code alone (its registers are at the limit).
template <typename T, bool kQuant>
__device__ __forceinline__ void run_item(const PersistentDecodeParams& p, const Op& op, int64_t item, int step,
                         const WeightStages<T>& st, int stage, float* smem) {
  auto buf = [&](int32_t b) { return reinterpret_cast<T*>(p.buffers[b]); };
  const int64_t parts = parts_per_row(p, op);
  const int b = int(item / parts), part = int(item % parts);  // small ops: (batch row, part)
  const int64_t qkv_w = buffer_width(p, int32_t(Buffer::kQkv));
  const int64_t layer_elems = p.num_blocks * 2 * p.dims.n_kv_heads * p.block_size * int64_t(p.dims.head_dim);
  T* kv_layer = static_cast<T*>(p.kv_base) + (op.layer < 0 ? 0 : op.layer) * layer_elems;
  const AttnShape as{int(p.dims.n_q_heads), int(p.dims.n_kv_heads), int(p.dims.head_dim), p.block_size, p.dims.attn_scale};
  switch (op.op) {
    case int32_t(Opcode::kEmbed):
      embed_item<T>(static_cast<const T*>(op.w0), reinterpret_cast<const int32_t*>(p.buffers[op.in]), buf(op.out),
                    p.dims.hidden, buffer_width(p, op.out), b, part);
      break;
    case int32_t(Opcode::kRmsNorm):
      if constexpr (!kQuant) {  // (a quantized program has no lanes: expand_gpu_program)
        const int64_t w = buffer_width(p, op.out), h = p.dims.hidden;
        if (lane_wide(p, w)) {  // lane l of row b is row b n_lanes + l of hidden, its own weight row or the shared one
          const int64_t per_lane = op.residual >= 0 ? 1 : (h + kRowChunk - 1) / kRowChunk;
          const int l = int(part / per_lane), lpart = int(part % per_lane), row = b * int(p.dims.n_lanes) + l;
          const T* nw = static_cast<const T*>(op.w0) + (p.dims.lane_norm_weights ? l * h : 0);
          if (op.residual >= 0)
            rmsnorm_item<T>(buf(op.in), buf(op.residual), nw, buf(op.out), h, p.dims.rms_eps, row, smem);
          else
            rmsnorm_chunk_item<T>(buf(op.in), nw, buf(op.out), h, p.dims.rms_eps, row, lpart, smem);
          break;
        }
      }
      if (op.residual >= 0)
        rmsnorm_item<T>(buf(op.in), buf(op.residual), static_cast<const T*>(op.w0), buf(op.out),
                        buffer_width(p, op.out), p.dims.rms_eps, b, smem);
      else
        rmsnorm_chunk_item<T>(buf(op.in), static_cast<const T*>(op.w0), buf(op.out), buffer_width(p, op.out),
                              p.dims.rms_eps, b, part, smem);
      break;
    case int32_t(Opcode::kLinear):
    case kOpLinearSamplePartial:  // the LM head, then (last item of a chunk) SAMPLE's first phase
    case kOpLinearRopeKv:      // QKV's rows, a RoPE pair per warp -> QKV (q, k rotated) and the cache
    case kOpLinearSiluMul:     // GATE_UP's rows [2 * inter, hidden] -> ACT [B, inter]
    case schedule::kOpRouterGemv: {  // the router's rows -> the MoE scratch's logits (T)
      // x rows are width(in) apart, and so long are the weight rows (a lane LINEAR's: width(in) / lanes)
      const int64_t x_stride = buffer_width(p, op.in);
      const bool router = op.op == schedule::kOpRouterGemv;
      T* const logits = static_cast<T*>(p.moe.logits);  // both loaded: see gemv_rows
      T* to_buffer = buf(op.out);
      if constexpr (!kQuant)  // a rank's vocabulary slice of LOGITS (a rank's program has no GPU formats)
        to_buffer += op.vocab_slice ? schedule::lane_logits_offset(p.dims) : 0;
      const int64_t rows = gemv_rows(p, op), width = buffer_width(p, op.out);
      T* out = router ? logits : to_buffer;
      const int64_t out_w = router ? rows : width;
      const GemvPrologue<T> pro{static_cast<const T*>(op.w2), p.dims.rms_eps};  // x = rmsnorm(in) * w2
      if constexpr (kQuant) {
        // uniform over the grid: one op's weights
        auto quant_gemv = [&](auto wtag) {
          using W = decltype(wtag);
          linear_item<T, T, kStagedVecs>(static_cast<const W*>(op.w0), op.w_scale, static_cast<const T*>(op.w1),
                                         buf(op.in), x_stride, out, out_w, p.batch,
                                         gemv_rows(p, op), x_stride, item, st, stage, gemv_epilogue<T>(p, op, kv_layer),
                                         pro);
        };
        if (op.w_type == schedule::kWeightFp8) {
          quant_gemv(Fp8E4M3{});
          break;
        }
        if (op.w_type == schedule::kWeightQ4Groups) {
          quant_gemv(Int4Groups{});
          break;
        }
        if (op.w_type == schedule::kWeightQ4K) {
          quant_gemv(Int4Q4K{});
          break;
        }
      }
      if constexpr (!kQuant) {  // (a quantized program has no lanes: expand_gpu_program)
        if (op.lanes > 1) {  // uniform over the grid: a lane LINEAR, its own instantiation
          const GemvLanes lanes = GemvLanes::of(p.dims, op);
          linear_item<T, T, kStagedVecs, true, true>(static_cast<const T*>(op.w0), static_cast<const float*>(nullptr),
                                                     static_cast<const T*>(op.w1), buf(op.in), x_stride, out, out_w,
                                                     p.batch, gemv_rows(p, op), x_stride / op.lanes, item, st, stage,
                                                     gemv_epilogue<T>(p, op, kv_layer), pro, lanes);
          break;
        }
      }
      linear_item<T, T, kStagedVecs>(static_cast<const T*>(op.w0), static_cast<const float*>(nullptr),
                                     static_cast<const T*>(op.w1), buf(op.in), x_stride, out, out_w, p.batch,
                                     gemv_rows(p, op), x_stride, item, st, stage, gemv_epilogue<T>(p, op, kv_layer), pro);
      break;
    }
    case int32_t(Opcode::kQkNorm):
      qk_norm_item<T>(buf(op.in), qkv_w, static_cast<const T*>(op.w0), static_cast<const T*>(op.w1), p.dims.n_q_heads,
                      p.dims.n_kv_heads, p.dims.head_dim, p.dims.rms_eps, b, part);
      break;
    case int32_t(Opcode::kRope):
      rope_item<T>(buf(op.in), qkv_w, p.inv_freq, p.positions[b], p.dims.n_q_heads + p.dims.n_kv_heads, p.dims.head_dim,
                   p.dims.rotary_dim, p.dims.rope_neox, b, part);
      break;
    case int32_t(Opcode::kKvAppend):
      kv_append_item<T>(buf(op.in), qkv_w, kv_layer, p.slots[b], p.dims.n_q_heads, p.dims.n_kv_heads, p.dims.head_dim,
                        p.block_size, b, part);
      break;
    case int32_t(Opcode::kAttnDecode): {  // item = (b, kv head g, part): the GQA group of g
      const int part = int(item % p.max_parts), g = int(item / p.max_parts % p.dims.n_kv_heads);
      const int sb = int(item / (int64_t(p.max_parts) * p.dims.n_kv_heads));
      const int group = int(p.dims.n_q_heads / p.dims.n_kv_heads), hd = int(p.dims.head_dim);
      const int64_t head_stride = int64_t(p.max_parts) * (hd + 2);
      // partials [B, n_q_heads, max_parts, hd + 2]: head 0 of sequence sb, then this item's part
      float* seq_partials = p.attn_partials + int64_t(sb) * p.dims.n_q_heads * head_stride;
      attn_partial_item<T>(buf(op.in) + sb * qkv_w, kv_layer, p.block_tables + int64_t(sb) * p.max_blocks,
                           p.seq_lens[sb], g, seq_partials + part * (hd + 2), head_stride, as, part,
                           p.attn_partition, op.window, smem);  // ends with __syncthreads: smem is free
      // The group's last item to finish merges its parts (FlashDecoding's combine, without an op
      // and a grid-wide wait of its own).
      if (last_of_group(p.attn_group_counts + int64_t(sb) * p.dims.n_kv_heads + g, unsigned(p.max_parts), smem))
        attn_combine_heads<T>(seq_partials + int64_t(g) * group * head_stride, head_stride, group,
                              attn_parts(p.seq_lens[sb], p.attn_partition),
                              buf(op.out) + (int64_t(sb) * p.dims.n_q_heads + int64_t(g) * group) * hd, hd);
      break;
    }
    case int32_t(Opcode::kSiluMul):
      silu_mul_item<T>(buf(op.in), buf(op.out), p.dims.intermediate, b, part);
      break;
    case schedule::kOpMoeGateUp:  // item = (group, part): the group's expert's rows
    case schedule::kOpMoeDown: {
      if constexpr (kQuant)  // unstaged: the quantized kernel's registers are spent (docs/GPU.md)
        moe_expert_item<T, 0>(p, op, item, NoStages<T>{}, -1);
      else
        moe_expert_item<T, kStagedVecs>(p, op, item, st, stage);
      break;
    }
    case schedule::kOpMoeCombine:
      moe_combine_item<T>(p, buf(op.out), b, part);
      break;
    case int32_t(Opcode::kLaneScale):
    case int32_t(Opcode::kLaneSum):
    case int32_t(Opcode::kLaneGather):
    case int32_t(Opcode::kLaneAddPast):
    case int32_t(Opcode::kLaneMean):
    case int32_t(Opcode::kLaneMergeSum):
      if constexpr (!kQuant) {
        if (op.comm >= 0) {  // a tensor-parallel rank's half of a cross-rank op (rank_items.cuh)
          if (op.comm_push)
            rank_push_item<T>(p, op, buf(op.in), op.residual >= 0 ? buf(op.residual) : nullptr, b, part, step,
                              unsigned(items_of(p, op)), smem);
          else
            rank_finish_item<T>(p, op, buf(op.in), op.out >= 0 ? buf(op.out) : nullptr, b, part, step);
          break;
        }
        lane_op_item<T>(p, op, buf(op.in), buf(op.out), op.residual >= 0 ? buf(op.residual) : nullptr,
                        buf(int32_t(Buffer::kLaneHist)), b, part);
      }
      break;
    case int32_t(Opcode::kAllReduce):  // only on a tensor-parallel rank: push or finish (expand_gpu_program)
    case int32_t(Opcode::kAllGather):
      if constexpr (!kQuant) {
        if (op.comm_push)
          rank_push_item<T>(p, op, buf(op.in), nullptr, b, part, step, unsigned(items_of(p, op)), smem);
        else
          rank_logits_finish_item<T>(p, op, buf(op.out), item, step);  // then SAMPLE's first phase: the op loop
      }
      break;
    case int32_t(Opcode::kSample): {  // item = b: the draw from the partial's summaries
      const int64_t n_chunks = sample_chunks(p.dims.vocab), first = int64_t(b) * n_chunks;
      const int token = sample_from_summaries(p.sample_summaries + first, int(n_chunks),
                                              p.sample_values + first * kSampleCandidateSlots,
                                              p.sample_indices + first * kSampleCandidateSlots,
                                              p.logits_out + int64_t(b) * p.dims.vocab, int(p.dims.vocab),
                                              p.sampling[b], p.rng_step + uint64_t(step), smem);
      if (threadIdx.x == 0) {
        const bool was_done = p.finished[b] != 0;
        p.out_tokens[step * p.batch + b] = was_done ? -1 : token;
        reinterpret_cast<int32_t*>(p.buffers[op.out])[b] = token;
        bool stop = false;
        for (int i = 0; i < p.n_stop_ids; ++i) stop |= token == p.stop_ids[i];
        if (stop) p.finished[b] = 1;
        if (step + 1 < p.n_steps) {  // the next step decodes the token just sampled
          const int64_t pos = p.positions[b] + 1;
          p.positions[b] = pos;
          p.seq_lens[b] = int32_t(pos + 1);
          p.slots[b] = int64_t(p.block_tables[int64_t(b) * p.max_blocks + pos / p.block_size]) * p.block_size +
                       pos % p.block_size;
        }
      }
      break;
    }
    default: break;
  }
}

// Workgroups that run items of op, each signalling once when its last item of op is done: the
// op's counter target.
__device__ __forceinline__ unsigned signalling_workgroups(const PersistentDecodeParams& p, const Op& op) {
  const int64_t n = items_of(p, op);
  return unsigned(n < int64_t(gridDim.x) ? n : int64_t(gridDim.x));
}

// Every thread of the workgroup calls it; returns once each op ops[i] of the step whose counters
// start at step_base completed all of its items (thread 0 spins, then one sync and acquire).
// A wait past p.wait_timeout_ticks records (op, counter, target, block) in p.timeout and traps.
__device__ __forceinline__ void wait_for_ops(const PersistentDecodeParams& p, const int32_t* ops, int32_t n,
                                             int64_t step_base) {
  if (threadIdx.x == 0)
    for (int32_t k = 0; k < n; ++k) {
      const int32_t d = ops[k];
      const unsigned target = signalling_workgroups(p, p.program[d]);
      const unsigned* counter = &p.counters[step_base + d];
      if (!spin_until(counter, target, p.wait_timeout_ticks))
        trap_timed_out(p.timeout, int32_t(step_base / p.n_ops), d, load_acquire(counter), target);
    }
  __syncthreads();
  fence_acquire();
}


// Whether this kernel runs op's items from weight stages: the GEMVs, and (float kernel) the
// experts' GEMVs.
template <bool kQuant>
__device__ __forceinline__ bool staged_op(const Op& op) {
  return schedule::is_gemv(op) || (!kQuant && schedule::is_moe_expert_gemv(op));
}

// Where a staged op's item reads its weights (StageSource); false: an expert item that runs
// nothing (its group is past the step's groups). An expert item's source reads the route: see
// moe_stage_source.
template <typename T, bool kQuant>
__device__ __forceinline__ bool stage_source(const PersistentDecodeParams& p, const Op& op, int64_t item, StageSource& src) {
  if (schedule::is_moe_expert_gemv(op)) return moe_stage_source<T>(p, op, item, src);
  src.w = op.w0, src.n = gemv_rows(p, op), src.row_bytes = gemv_row_bytes<T>(op, gemv_k<kQuant>(p, op));
  src.item = item, src.rows = gemv_epilogue<T>(p, op, nullptr).rows();
  return true;
}

// The next staged GEMV item this workgroup will run from op j on: item `cand` of op j if op j is
// one, else its first item (blockIdx.x) of a later one that has one; with `wrap`, the next step's
// ops after this step's (wrapped: the item is the next step's). False when there is none, or
// when the walk meets an expert GEMV whose route this workgroup does not know: only the layer
// route_layer's of this step (it waited for an op of that layer after its router), since the
// route scratch holds one layer's route at a time. The quantized kernel runs experts unstaged.
template <bool kQuant>
__device__ inline bool next_linear_item(const PersistentDecodeParams& p, int32_t j, int64_t cand, bool wrap,
                                        int32_t route_layer, int32_t& op, int64_t& item, bool& wrapped) {
  bool this_step = true;
  int32_t l = j < p.n_ops ? p.next_linear[j] : p.n_ops;
  while (true) {
    if (l >= p.n_ops) {
      if (!wrap) return false;
      wrap = this_step = false;
      l = p.next_linear[0];
      if (l >= p.n_ops) return false;
    }
    if (schedule::is_moe_expert_gemv(p.program[l])) {
      if (kQuant) {  // not staged: skip it
        l = l + 1 < p.n_ops ? p.next_linear[l + 1] : p.n_ops;
        continue;
      }
      if (!this_step || p.program[l].layer != route_layer) return false;  // its route is not known yet
    }
    const int64_t c = this_step && l == j ? cand : int64_t(blockIdx.x);
    if (c < items_of(p, p.program[l])) {
      op = l, item = c, wrapped = !this_step;
      return true;
    }
    l = l + 1 < p.n_ops ? p.next_linear[l + 1] : p.n_ops;
  }
}

// Fills the free stages with the next GEMV items from (op j, item cand) on, in the order this
// workgroup will run them (items already staged are skipped, not reloaded).
template <typename T, bool kQuant>
__device__ inline void stage_next(const PersistentDecodeParams& p, WeightStages<T>& st, int32_t j, int64_t cand,
                                  int step, int32_t route_layer) {
  bool wrap = step + 1 < p.n_steps, wrapped = false;
  for (int k = 0; k < kStages; ++k) {
    int32_t o;
    int64_t i;
    if (!next_linear_item<kQuant>(p, j, cand, wrap, route_layer, o, i, wrapped)) return;
    if (st.find(o, i) < 0) {
      const int s = st.free_stage();
      if (s < 0) return;
      StageSource src;
      if (stage_source<T, kQuant>(p, p.program[o], i, src)) st.issue(s, o, i, src);  // else: runs nothing
    }
    j = o, cand = i + gridDim.x;
    wrap = wrap && !wrapped;  // one step ahead at most
  }
}

template <typename T, bool kQuant>
__global__ void __launch_bounds__(kThreads, 1) persistent_decode_kernel(PersistentDecodeParams p) {
  __shared__ float smem[kSmemFloats];
  __shared__ int all_done;
  extern __shared__ uint4 stage_smem[];  // kStageSmemBytes: the weight stages (NVIDIA)
  WeightStages<T> st;
  st.init(stage_smem);
  for (int step = 0; step < p.n_steps; ++step) {
    // The layer whose route (the MoE scratch) this workgroup has acquired this step: it waited for
    // an op of that layer after the router. Its expert items may be staged; no other layer's.
    int32_t route_layer = -1;
    if (step > 0) {  // every workgroup: the whole previous step completed (its sinks, SAMPLE included)
      wait_for_ops(p, p.step_sinks, p.n_sinks, int64_t(step - 1) * p.n_ops);
      if (threadIdx.x == 0) {
        int done = 1;
        for (int b = 0; b < p.batch; ++b) done &= p.finished[b] != 0;
        all_done = done;
      }
      __syncthreads();
      if (all_done) break;  // uniform over the grid: every workgroup reads the same flags
    }
    for (int j = 0; j < p.n_ops; ++j) {
      const int64_t g = int64_t(step) * p.n_ops + j;
      const Op& op = p.program[j];
      const int64_t n_items = items_of(p, op);
      bool ready = op.n_deps == 0;  // deps are ops of this step: the step's start waited for the last
      // The next LINEAR item's weights load while this op waits and runs (weights never depend
      // on activations); a workgroup with no item here runs ahead to its next op.
      stage_next<T, kQuant>(p, st, j, blockIdx.x, step, route_layer);
      for (int64_t item = blockIdx.x; item < n_items; item += gridDim.x) {
        if (!ready) {
          wait_for_ops(p, op.deps, op.n_deps, int64_t(step) * p.n_ops);
          if constexpr (!kQuant)
            if (op.comm >= 0 && !op.comm_push) wait_for_ranks(p, op, j, step);  // every rank's push of the step
          ready = true;
          // an op of an MoE layer after its router: that layer's route is complete and acquired
          if (schedule::is_moe_expert_gemv(op) || op.op == schedule::kOpMoeCombine) route_layer = op.layer;
        }
        int stage = -1;
        StageSource src;
        if (staged_op<kQuant>(op) && stage_source<T, kQuant>(p, op, item, src)) {
          stage = st.find(j, item);  // staged by stage_next, before this op or during the last item
          if (stage < 0) {           // not reached (the first expert items of a layer; else the next
            st.reset();              // item is staged whenever a stage frees)
            stage = 0;
            st.issue(stage, j, item, src);
          }
          // NVIDIA: the next items load while this runs
          stage_next<T, kQuant>(p, st, j, item + gridDim.x, step, route_layer);
          st.wait(stage);
        }
        run_item<T, kQuant>(p, op, item, step, st, stage, smem);
        if (stage >= 0) {
          st.release(stage);
          // into the stage just freed (AMD: the only one)
          stage_next<T, kQuant>(p, st, j, item + gridDim.x, step, route_layer);
        }
        // a tensor-parallel rank's logits finish: its item is a whole chunk of LOGITS
        const bool chunk_item = !kQuant && schedule::is_logits_finish(op);
        if (op.op == kOpLinearSamplePartial || chunk_item)  // after the staging: the next weights load during the tail
          sample_partial_tail<T>(p, reinterpret_cast<const T*>(p.buffers[op.out]), item, chunk_item, smem);
        if (op.op == schedule::kOpRouterGemv && last_of_group(p.moe.route_count, unsigned(n_items), smem))
          moe_route_tail<T>(p, op, smem);  // the last router item: routes, groups, gathers
        __syncthreads();  // the next item may reuse shared memory (the signal's barrier did this)
      }
      // One signal per workgroup that ran items of the op, after its last (one release fence
      // instead of one per item: the LM head's ~60 items per workgroup on an H200), so an op is
      // complete at signalling_workgroups(). Tests skip it to lose a signal (uniform over the grid).
      if (blockIdx.x < n_items && g != p.debug_skip_signal_op) signal_done(&p.counters[g]);
    }
  }
  st.reset();  // a look-ahead into the next step may still be in flight
  // The last workgroup out zeroes the counters for the next launch: every other workgroup has
  // passed all of its waits by then.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(p.exit_count, 1u) == gridDim.x - 1) {
      for (int64_t i = 0; i < int64_t(p.n_steps) * p.n_ops; ++i) p.counters[i] = 0;
      *p.exit_count = 0;
      __threadfence();
    }
  }
}

}  // namespace

}  // namespace kog::gpu::decode
