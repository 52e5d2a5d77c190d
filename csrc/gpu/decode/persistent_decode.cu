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
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gpu/decode/attention_item.cuh"
#include "gpu/decode/executor.h"
#include "gpu/decode/linear_item.cuh"
#include "gpu/decode/sample_item.cuh"
#include "gpu/decode/small_items.cuh"

namespace kog::gpu::decode {

using schedule::Buffer;
using schedule::Opcode;

static_assert(GpuDecodeExecutor::kMaxBatch == kMaxBatch, "one batch limit");

namespace {

constexpr int kMaxOf(int a, int b) { return a > b ? a : b; }
constexpr int kSmemFloats = kMaxOf(kAttnPartialSmemFloats, kMaxOf(kSampleSmemFloats, kSampleChunkSmemFloats));

__host__ __device__ __forceinline__ int64_t buffer_width(const PersistentDecodeParams& p, int32_t b) {
  return schedule::buffer_width(p.dims, b);
}

// Weight rows of a GEMV op (schedule::is_gemv): its output width, or both halves of a fused
// gate/up.
__device__ __forceinline__ int64_t gemv_rows(const PersistentDecodeParams& p, const Op& op) {
  return op.op == kOpLinearSiluMul ? 2 * p.dims.intermediate : buffer_width(p, op.out);
}

// Bytes of one weight row of a GEMV op over k inputs: FP8 weights take one byte an element.
template <typename T>
__device__ __forceinline__ int64_t gemv_row_bytes(const Op& op, int64_t k) {
  return op.w_type == schedule::kWeightFp8 ? k : k * int64_t(sizeof(T));
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
    case int32_t(Opcode::kEmbed): return ceil_div(p.dims.hidden, kRowChunk);
    case int32_t(Opcode::kRmsNorm): return op.residual >= 0 ? 1 : ceil_div(buffer_width(p, op.out), kRowChunk);
    case int32_t(Opcode::kQkNorm): return ceil_div(p.dims.n_q_heads + p.dims.n_kv_heads, kThreads / KOG_WARP_SIZE);
    case int32_t(Opcode::kRope): return ceil_div(p.dims.n_q_heads + p.dims.n_kv_heads, kRopeHeads);
    case int32_t(Opcode::kKvAppend): return p.dims.n_kv_heads;
    case int32_t(Opcode::kSiluMul): return ceil_div(p.dims.intermediate, kRowChunk);
    default: return 1;  // SAMPLE: one item per sequence
  }
}

__device__ inline int64_t items_of(const PersistentDecodeParams& p, const Op& op) {
  switch (op.op) {
    case int32_t(Opcode::kLinear):
    case kOpLinearSamplePartial:
    case kOpLinearSiluMul:  // fused: a pair of rows per warp
    case kOpLinearRopeKv:
      return linear_items(gemv_rows(p, op), op.op == kOpLinearSiluMul || op.op == kOpLinearRopeKv);
    case int32_t(Opcode::kAttnDecode): return int64_t(p.batch) * p.dims.n_kv_heads * p.max_parts;
    default: return int64_t(p.batch) * parts_per_row(p, op);
  }
}

// st / stage: for a LINEAR, the stage holding the item's first weight vectors (landed).
// The LM head's item tail: the last of a chunk's items to finish writes, for every sequence,
// the chunk's f32 logits output and its summary (SAMPLE's first phase, without an op and a
// grid-wide wait of its own). Item i holds logit rows [i * rows, (i + 1) * rows), rows =
// linear_rows_per_item(), so chunk c's items are [c * per_chunk, (c + 1) * per_chunk).
template <typename T>
__device__ inline void sample_partial_tail(const PersistentDecodeParams& p, const T* logits, int64_t item,
                                           float* smem) {
  static_assert(kSampleChunk % (kWarps * kLinearRowsPerWarp) == 0, "a sample chunk is whole LM-head items");
  constexpr int64_t per_chunk = kSampleChunk / (kWarps * kLinearRowsPerWarp);
  const int64_t chunk = item / per_chunk, n_chunks = sample_chunks(p.dims.vocab);
  const int64_t left = linear_items(p.dims.vocab) - chunk * per_chunk, in_chunk = left < per_chunk ? left : per_chunk;
  if (!last_of_group(p.sample_chunk_counts + chunk, unsigned(in_chunk), smem)) return;
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

// kFp8: the program has FP8 GEMVs (schedule::kWeightFp8); only then is the FP8 GEMV compiled in,
// so a float model's kernel is the float GEMV's code alone (its registers are at the limit).
template <typename T, bool kFp8>
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
                    p.dims.hidden, b, part);
      break;
    case int32_t(Opcode::kRmsNorm):
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
    case kOpLinearSiluMul: {   // GATE_UP's rows [2 * inter, hidden] -> ACT [B, inter]
      const int64_t k = buffer_width(p, op.in);
      const GemvPrologue<T> pro{static_cast<const T*>(op.w2), p.dims.rms_eps};  // x = rmsnorm(in) * w2
      if constexpr (kFp8) {
        if (op.w_type == schedule::kWeightFp8) {  // uniform over the grid: one op's weights
          linear_item<T, T, kStagedVecs>(static_cast<const Fp8E4M3*>(op.w0), op.w_scale, static_cast<const T*>(op.w1),
                                         buf(op.in), k, buf(op.out), buffer_width(p, op.out), p.batch,
                                         gemv_rows(p, op), k, item, st, stage, gemv_epilogue<T>(p, op, kv_layer), pro);
          break;
        }
      }
      linear_item<T, T, kStagedVecs>(static_cast<const T*>(op.w0), static_cast<const float*>(nullptr),
                                     static_cast<const T*>(op.w1), buf(op.in), k, buf(op.out), buffer_width(p, op.out),
                                     p.batch, gemv_rows(p, op), k, item, st, stage, gemv_epilogue<T>(p, op, kv_layer),
                                     pro);
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
      if (!spin_until(counter, target, p.wait_timeout_ticks)) {
        WaitTimeout* t = p.timeout;
        if (atomicCAS(&t->fired, 0, 1) == 0) {
          t->block = int32_t(blockIdx.x), t->step = int32_t(step_base / p.n_ops), t->op = d;
          t->count = load_acquire(counter), t->target = target;
          __threadfence_system();
        }
        gpu_trap();
      }
    }
  __syncthreads();
  fence_acquire();
}


// The next GEMV item this workgroup will run from op j on: item `cand` of op j if op j is a
// GEMV, else its first item (blockIdx.x) of a later GEMV that has one; with `wrap`, the next
// step's ops after this step's (wrapped: the item is the next step's). False when there is none.
__device__ inline bool next_linear_item(const PersistentDecodeParams& p, int32_t j, int64_t cand, bool wrap,
                                        int32_t& op, int64_t& item, bool& wrapped) {
  bool this_step = true;
  int32_t l = j < p.n_ops ? p.next_linear[j] : p.n_ops;
  while (true) {
    if (l >= p.n_ops) {
      if (!wrap) return false;
      wrap = this_step = false;
      l = p.next_linear[0];
      if (l >= p.n_ops) return false;
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
template <typename T>
__device__ inline void stage_next(const PersistentDecodeParams& p, WeightStages<T>& st, int32_t j, int64_t cand,
                                  int step) {
  bool wrap = step + 1 < p.n_steps, wrapped = false;
  for (int k = 0; k < kStages; ++k) {
    int32_t o;
    int64_t i;
    if (!next_linear_item(p, j, cand, wrap, o, i, wrapped)) return;
    if (st.find(o, i) < 0) {
      const int s = st.free_stage();
      if (s < 0) return;
      const Op& l = p.program[o];
      st.issue(s, o, i, l.w0, gemv_rows(p, l), gemv_row_bytes<T>(l, buffer_width(p, l.in)),
               gemv_epilogue<T>(p, l, nullptr).rows());
    }
    j = o, cand = i + gridDim.x;
    wrap = wrap && !wrapped;  // one step ahead at most
  }
}

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) persistent_decode_kernel(PersistentDecodeParams p) {
  __shared__ float smem[kSmemFloats];
  __shared__ int all_done;
  extern __shared__ uint4 stage_smem[];  // kStageSmemBytes: the weight stages (NVIDIA)
  WeightStages<T> st;
  st.init(stage_smem);
  for (int step = 0; step < p.n_steps; ++step) {
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
      stage_next<T>(p, st, j, blockIdx.x, step);
      for (int64_t item = blockIdx.x; item < n_items; item += gridDim.x) {
        if (!ready) {
          wait_for_ops(p, op.deps, op.n_deps, int64_t(step) * p.n_ops);
          ready = true;
        }
        int stage = -1;
        if (schedule::is_gemv(op)) {
          stage = st.find(j, item);  // staged by stage_next, before this op or during the last item
          if (stage < 0) {           // not reached (the next item is staged whenever a stage frees)
            st.reset();
            stage = 0;
            st.issue(stage, j, item, op.w0, gemv_rows(p, op), gemv_row_bytes<T>(op, buffer_width(p, op.in)),
                     gemv_epilogue<T>(p, op, nullptr).rows());
          }
          stage_next<T>(p, st, j, item + gridDim.x, step);  // NVIDIA: the next items load while this runs
          st.wait(stage);
        }
        run_item<T, kFp8>(p, op, item, step, st, stage, smem);
        if (stage >= 0) {
          st.release(stage);
          stage_next<T>(p, st, j, item + gridDim.x, step);  // into the stage just freed (AMD: the only one)
        }
        if (op.op == kOpLinearSamplePartial)  // after the staging: the next weights load during the tail
          sample_partial_tail<T>(p, reinterpret_cast<const T*>(p.buffers[op.out]), item, smem);
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

template <typename T, bool kFp8>
void* kernel_of() {
  return reinterpret_cast<void*>(&persistent_decode_kernel<T, kFp8>);
}

// The kernel for run dtype t; fp8: with the FP8 GEMV (16-bit run dtypes only: FP8 models run
// with bf16 or f16 activations, one instantiation fewer of a kernel slow to compile).
void* kernel_for(DType t, bool fp8) {
  void* k = nullptr;
  if (!fp8)
    dispatch_float(t, [&](auto tag) { k = kernel_of<decltype(tag), false>(); });
  else if (t == DType::kBF16)
    k = kernel_of<gpu_bf16, true>();
  else if (t == DType::kF16)
    k = kernel_of<gpu_f16, true>();
  return k;
}

}  // namespace

GpuDecodeExecutor::GpuDecodeExecutor(const ModelDims& dims, const KVCacheDesc& kv, const float* inv_freq,
                                     const std::vector<Op>& ops)
    : d_(dims), kv_(kv), inv_freq_(inv_freq), n_ops_(int32_t(ops.size())) {
  // ops come from schedule::expand_gpu_program, which validated them and the dims.
  KOG_ASSERT(!ops.empty(), "gpu decode: empty program");
  KOG_CHECK(dims.head_dim % 2 == 0 && attn_vectorizable(dims.head_dim, dtype_size(dims.dtype)), "gpu decode: head_dim ",
            dims.head_dim, " must be even, <= ", kMaxHeadDim, " and a multiple of 16 bytes");
  KOG_CHECK(kv.block_size > 0 && kv.block_size <= INT32_MAX, "gpu decode: block_size ", kv.block_size);
  const int64_t elem = dtype_size(dims.dtype);
  const int64_t vec = 16 / elem;
  KOG_CHECK(dims.hidden % vec == 0 && dims.intermediate % vec == 0 && (dims.n_q_heads * dims.head_dim) % vec == 0,
            "gpu decode: hidden, intermediate and q width must be multiples of ", vec, " elements");
  for (const Op& o : ops) {
    fp8_ = fp8_ || o.w_type == schedule::kWeightFp8;
    if (schedule::is_gemv(o)) {
      KOG_CHECK(reinterpret_cast<uintptr_t>(o.w0) % 16 == 0 && reinterpret_cast<uintptr_t>(o.w2) % 16 == 0,
                "gpu decode: LINEAR and prologue norm weights must be 16-byte aligned");
      // An FP8 row is one 16-byte vector per 16 elements (validate_program checked k % 16).
      KOG_CHECK(o.w_type == schedule::kWeightRunDtype || (o.w_type == schedule::kWeightFp8 && o.w_scale != nullptr),
                "gpu decode: a GEMV weight is neither the run dtype nor FP8 with row scales");
    }
  }
  KOG_CHECK(!fp8_ || dims.dtype == DType::kBF16 || dims.dtype == DType::kF16, "gpu decode: FP8 weights run with ",
            "bfloat16 or float16 activations, not ", dtype_name(dims.dtype));
  // TOKENS lives in the caller's tensor; every other buffer (LOGITS too) in the arena.
  int64_t offsets[int(Buffer::kNumBuffers)];
  int64_t total = 0;
  for (int b = 0; b < int(Buffer::kNumBuffers); ++b) {
    offsets[b] = total;
    const int64_t bytes = b == int(Buffer::kTokens) ? 0 : kMaxBatch * schedule::buffer_width(d_, b) * elem;
    total += (bytes + 255) / 256 * 256;
  }
  KOG_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&arena_), size_t(total)));
  for (int b = 0; b < int(Buffer::kNumBuffers); ++b) buffers_[b] = arena_ + offsets[b];
  KOG_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&program_), ops.size() * sizeof(Op)));
  KOG_GPU_CHECK(gpuMemcpyAsync(program_, ops.data(), ops.size() * sizeof(Op), gpuMemcpyHostToDevice, nullptr));
  // next_linear[j]: the first LINEAR op at or after op j (n_ops: none), for weight staging.
  std::vector<int32_t> next_linear(ops.size());
  for (int32_t j = n_ops_ - 1, l = n_ops_; j >= 0; --j) {
    if (schedule::is_gemv(ops[size_t(j)])) l = j;
    next_linear[size_t(j)] = l;
  }
  KOG_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&next_linear_), ops.size() * sizeof(int32_t)));
  KOG_GPU_CHECK(gpuMemcpyAsync(next_linear_, next_linear.data(), ops.size() * sizeof(int32_t), gpuMemcpyHostToDevice,
                               nullptr));
  const std::vector<int32_t> sinks = schedule::program_sinks(ops);
  n_sinks_ = int32_t(sinks.size());
  KOG_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&sinks_), sinks.size() * sizeof(int32_t)));
  KOG_GPU_CHECK(gpuMemcpyAsync(sinks_, sinks.data(), sinks.size() * sizeof(int32_t), gpuMemcpyHostToDevice, nullptr));
  // The sample partial's summaries and candidate slots: [kMaxBatch, chunks] and
  // [kMaxBatch, chunks, kSampleCandidateSlots] floats and ints, in one allocation.
  const size_t chunks = size_t(kMaxBatch) * size_t(sample_chunks(dims.vocab));
  const size_t summary_bytes = (chunks * sizeof(SampleChunk) + 255) / 256 * 256;
  const size_t slot_bytes = chunks * kSampleCandidateSlots * sizeof(float);
  KOG_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&sample_scratch_), summary_bytes + 2 * slot_bytes));
  sample_summaries_ = reinterpret_cast<SampleChunk*>(sample_scratch_);
  sample_values_ = reinterpret_cast<float*>(sample_scratch_ + summary_bytes);
  sample_indices_ = reinterpret_cast<int32_t*>(sample_scratch_ + summary_bytes + slot_bytes);
  // per-op counters, exit_count, the attention group counts, then the sample chunk counts
  const size_t counter_bytes = (size_t(kMaxLoopSteps) * ops.size() + 1 + size_t(kMaxBatch) * size_t(dims.n_kv_heads) +
                                size_t(sample_chunks(dims.vocab))) * sizeof(unsigned);
  KOG_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&counters_), counter_bytes));
  KOG_GPU_CHECK(gpuMemsetAsync(counters_, 0, counter_bytes, nullptr));
  KOG_GPU_CHECK(gpuStreamSynchronize(nullptr));

  int device = 0, per_sm = 0;
  KOG_GPU_CHECK(gpuGetDevice(&device));
  gpuDeviceProp_t prop;
  KOG_GPU_CHECK(gpuGetDeviceProperties(&prop, device));
  if (kStageSmemBytes > 0) {  // above the default 48 KiB a kernel must ask for its dynamic shared memory
#if defined(KOG_GPU_CUDA)
    gpuFuncAttributes attr;
    KOG_GPU_CHECK(gpuFuncGetAttributes(&attr, kernel_for(dims.dtype, fp8_)));
    KOG_CHECK_KIND(size_t(kStageSmemBytes) + attr.sharedSizeBytes <= prop.sharedMemPerBlockOptin, kBackend,
                   "gpu decode: the kernel needs ", kStageSmemBytes, " + ", attr.sharedSizeBytes,
                   " bytes of shared memory per block, the device gives ", prop.sharedMemPerBlockOptin);
#endif
    KOG_GPU_CHECK(gpuFuncSetAttribute(kernel_for(dims.dtype, fp8_), gpuFuncAttributeMaxDynamicSharedMemorySize,
                                      kStageSmemBytes));
  }
  KOG_GPU_CHECK(
      gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_for(dims.dtype, fp8_), kThreads, kStageSmemBytes));
  KOG_CHECK_KIND(per_sm > 0, kBackend, "gpu decode: the kernel cannot be resident on this device");
  grid_ = prop.multiProcessorCount * std::min(per_sm, kBlocksPerMultiprocessor);

  KOG_GPU_CHECK(gpuHostAlloc(reinterpret_cast<void**>(&timeout_host_), sizeof(WaitTimeout), gpuHostAllocMapped));
  std::memset(timeout_host_, 0, sizeof(WaitTimeout));
  KOG_GPU_CHECK(gpuHostGetDevicePointer(reinterpret_cast<void**>(&timeout_device_), timeout_host_, 0));
  ticks_per_ms_ = gpu_wall_ticks_per_ms(device);
  set_wait_timeout_ms(kDefaultWaitTimeoutMs);
}

void GpuDecodeExecutor::set_wait_timeout_ms(double ms) {
  KOG_CHECK(ms >= 0 && ms <= 1e9, "gpu decode: wait timeout ", ms, " ms not in [0, 1e9]");
  wait_timeout_ticks_ = uint64_t(ms * double(ticks_per_ms_));
}

WaitTimeout GpuDecodeExecutor::wait_timeout() const {
  const volatile WaitTimeout* v = timeout_host_;  // the device writes it behind the compiler's back
  return WaitTimeout{v->fired, v->block, v->step, v->op, v->count, v->target};
}

GpuDecodeExecutor::~GpuDecodeExecutor() {
  // Frees cannot throw out of a destructor: errors here are dropped.
  (void)gpuFreeHost(timeout_host_);
  (void)gpuFree(partials_);
  (void)gpuFree(sample_scratch_);
  (void)gpuFree(counters_);
  (void)gpuFree(sinks_);
  (void)gpuFree(next_linear_);
  (void)gpuFree(program_);
  (void)gpuFree(arena_);
}

void GpuDecodeExecutor::ensure_partials(int32_t max_parts) {
  if (max_parts <= partials_parts_) return;
  const int32_t parts = std::max(max_parts, 2 * partials_parts_);
  const size_t bytes = size_t(kMaxBatch) * d_.n_q_heads * parts * (d_.head_dim + 2) * sizeof(float);
  // NOTE: growth synchronizes (a launch in flight may still read the old scratch); it happens
  // only when the longest context passes a new power-of-two multiple of the partition.
  KOG_GPU_CHECK(gpuStreamSynchronize(nullptr));
  (void)gpuFree(partials_);
  partials_ = nullptr;
  KOG_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&partials_), bytes));
  partials_parts_ = parts;
}

void GpuDecodeExecutor::run(const GpuDecodeStep& s, void* stream) {
  KOG_CHECK(s.batch >= 1 && s.batch <= kMaxBatch, "gpu decode: batch ", s.batch, " not in [1, ", kMaxBatch, "]");
  KOG_CHECK(s.n_steps >= 1 && s.n_steps <= kMaxLoopSteps, "gpu decode: n_steps ", s.n_steps, " not in [1, ",
            kMaxLoopSteps, "]");
  KOG_CHECK(s.max_seq_len >= 1 && int64_t(s.max_seq_len) <= int64_t(s.max_blocks) * kv_.block_size,
            "gpu decode: max_seq_len ", s.max_seq_len, " exceeds the block tables (", s.max_blocks, " blocks of ",
            kv_.block_size, ")");
  KOG_CHECK(s.tokens && s.positions && s.seq_lens && s.slots && s.block_tables && s.sampling && s.out_tokens &&
                s.finished && s.logits && (s.n_stop_ids == 0 || s.stop_ids),
            "gpu decode: null step pointer");
  // Tokens per attention item: halved (down to kMinAttnPartition) until the partial phase has two
  // items per workgroup, so a short context still spreads its K/V reads over the device.
  int32_t partition = kAttnPartition;
  auto attn_items = [&](int32_t part) { return int64_t(s.batch) * d_.n_kv_heads * attn_parts(s.max_seq_len, part); };
  while (partition > kMinAttnPartition && attn_items(partition) < 2 * int64_t(grid_)) partition /= 2;
  const int32_t max_parts = attn_parts(s.max_seq_len, partition);
  ensure_partials(max_parts);

  PersistentDecodeParams p{};
  p.program = program_;
  p.n_ops = n_ops_;
  p.batch = s.batch;
  p.n_steps = s.n_steps;
  p.step_sinks = sinks_;
  p.next_linear = next_linear_;
  p.n_sinks = n_sinks_;
  p.dims = d_;
  p.inv_freq = inv_freq_;
  std::memcpy(p.buffers, buffers_, sizeof(buffers_));
  // Tokens and the f32 logits live in the caller's tensors, so they need no copy in or out.
  p.buffers[int(Buffer::kTokens)] = reinterpret_cast<char*>(s.tokens);
  p.logits_out = s.logits;
  p.attn_partials = partials_;
  p.sample_summaries = sample_summaries_, p.sample_values = sample_values_, p.sample_indices = sample_indices_;
  p.max_parts = max_parts;
  p.attn_partition = partition;
  p.kv_base = kv_.base, p.num_blocks = kv_.num_blocks, p.block_size = int32_t(kv_.block_size);
  p.positions = s.positions, p.seq_lens = s.seq_lens, p.slots = s.slots;
  p.block_tables = s.block_tables, p.max_blocks = s.max_blocks;
  p.sampling = s.sampling, p.rng_step = s.rng_step;
  p.stop_ids = s.stop_ids, p.n_stop_ids = s.n_stop_ids;
  p.out_tokens = s.out_tokens, p.finished = s.finished;
  p.counters = counters_;
  p.exit_count = counters_ + size_t(kMaxLoopSteps) * n_ops_;
  p.attn_group_counts = p.exit_count + 1;
  p.sample_chunk_counts = p.attn_group_counts + size_t(kMaxBatch) * size_t(d_.n_kv_heads);
  p.timeout = timeout_device_;
  p.wait_timeout_ticks = wait_timeout_ticks_;
  p.debug_skip_signal_op = debug_skip_signal_op_;

  void* args[] = {&p};
  KOG_GPU_CHECK(gpuLaunchCooperativeKernel(kernel_for(d_.dtype, fp8_), dim3(unsigned(grid_)), dim3(kThreads), args,
                                           size_t(kStageSmemBytes), as_stream(stream)));
}

}  // namespace kog::gpu::decode
