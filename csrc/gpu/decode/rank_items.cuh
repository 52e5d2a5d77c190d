// Cross-rank ops in the persistent decode kernel: the push and finish halves a tensor-parallel
// rank's program has (schedule/gpu_program.h, "cross-rank ops"; docs/GPU.md, "Tensor
// parallelism inside the persistent kernel"). Float kernels only. Layouts as lane_items.cuh: a
// lane-wide row is [n_lanes, hidden] (this rank's lanes), run dtype T.
//
// Inbox of rank q, channel c, parity s (= epoch % 2), part of rank r: RankExchange::inbox[q] +
// s * parity_bytes + offset[c] + r * part[c]. What a part holds, for B rows:
//   LANE_SUM / MEAN / MERGE_SUM: f32 [B, hidden], the rank's sum over its lanes of each element;
//   LANE_GATHER: T [B, n_lanes, hidden], the rank's lanes;
//   ALL_REDUCE: f32 [B, vocab], the rank's partial logits; ALL_GATHER: T [B, vocab / ranks], its slice.
// A push item stores its elements into every rank's inbox, then fences at system scope; the
// push's last item on this rank (last_of_group on push_counts[c]) stores the epoch into
// flags[c * ranks + this rank] of every rank. A finish waits (wait_for_ranks, thread 0, bounded)
// until its own flags[c * ranks + q] >= epoch for every q, then reads its own inbox only.
// Every sum over ranks adds them in rank order, each rank's part summed over its lanes in lane
// order first: the order of the CPU executor (engine/decode_lanes.cpp), so every rank and the
// CPU get the same bits.
#pragma once
#include "gpu/decode/params.h"
#include "gpu/decode/small_items.cuh"
#include "gpu/decode/sync.cuh"

namespace kog::gpu::decode {

using schedule::Opcode;

// The epoch a push of step `step` stores and its finish waits for: monotone over launches.
__device__ __forceinline__ uint64_t rank_epoch(const PersistentDecodeParams& p, int step) {
  return p.step_base + uint64_t(step) + 1;
}

// Where channel c's parts of the parity of `step` sit in every rank's inbox (the same place in
// each): rank r's part at inbox + offset + r * part. Read once per item, not per element.
struct ChannelParts {
  int64_t offset;  // bytes from an inbox's start to the channel's rank-0 part of this parity
  int64_t part;    // bytes of one rank's part
};

__device__ __forceinline__ ChannelParts channel_parts(const PersistentDecodeParams& p, int c, int step) {
  const RankExchange& x = *p.ranks;
  return {int64_t(rank_epoch(p, step) % 2) * x.parity_bytes + x.offset[c], x.part[c]};
}

// Items per batch row of a logits push: chunks of kRowChunk over the rank's slice (ALL_GATHER)
// or the whole vocabulary (ALL_REDUCE).
__device__ __forceinline__ int64_t logits_push_parts(const PersistentDecodeParams& p, const Op& op) {
  const int64_t w = op.op == int32_t(Opcode::kAllGather) ? p.dims.vocab / p.dims.lane_ranks : p.dims.vocab;
  return (w + kRowChunk - 1) / kRowChunk;
}

// Every thread calls it after its stores of one push item (n: the push's items on this rank).
// The last item to finish raises the channel's flag on every rank.
__device__ __forceinline__ void push_done(const PersistentDecodeParams& p, const Op& op, int step, unsigned n,
                                          float* smem) {
  __threadfence_system();  // this thread's stores into the peers' inboxes, before the count
  if (!last_of_group(p.ranks->push_counts + op.comm, n, smem)) return;
  if (threadIdx.x == 0) {
    __threadfence_system();  // with the stores below, the release of every item's inbox stores
    const int R = int(p.dims.lane_ranks), me = int(p.dims.lane_rank);
    for (int q = 0; q < R; ++q) store_relaxed_sys(p.ranks->flags[q] + int64_t(op.comm) * R + me, rank_epoch(p, step));
  }
}

// The push of a cross-rank op, item (b, part): LANE_SUM / MEAN / MERGE_SUM / GATHER over
// kRowChunk elements of every lane of row b; ALL_REDUCE / ALL_GATHER over kRowChunk logits.
template <typename T>
__device__ void rank_push_item(const PersistentDecodeParams& p, const Op& op, const T* in, const T* residual, int b,
                               int part, int step, unsigned n_items, float* smem) {
  const int R = int(p.dims.lane_ranks), me = int(p.dims.lane_rank);
  const int64_t L = p.dims.n_lanes, h = p.dims.hidden, V = p.dims.vocab;
  const ChannelParts cp = channel_parts(p, op.comm, step);
  const int64_t mine = cp.offset + int64_t(me) * cp.part;  // this rank's part, in every rank's inbox
  if (op.op == int32_t(Opcode::kAllReduce) || op.op == int32_t(Opcode::kAllGather)) {
    const bool gather = op.op == int32_t(Opcode::kAllGather);
    const int64_t w = gather ? V / R : V, v0 = gather ? int64_t(me) * w : 0;
    int64_t e0, e1;
    row_chunk(w, part, e0, e1);
    for (int q = 0; q < R; ++q) {
      char* dst = p.ranks->inbox[q] + mine;
      for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
        if (gather)
          reinterpret_cast<T*>(dst)[b * w + e] = in[b * V + v0 + e];
        else
          reinterpret_cast<float*>(dst)[b * V + e] = load_f32(in + b * V + e);
      }
    }
  } else {
    int64_t e0, e1;
    row_chunk(h, part, e0, e1);
    const T* row = in + b * L * h;
    const T* res = residual != nullptr ? residual + b * L * h : nullptr;
    for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
      if (op.op == int32_t(Opcode::kLaneGather)) {  // the lanes as they are
        for (int q = 0; q < R; ++q) {
          T* dst = reinterpret_cast<T*>(p.ranks->inbox[q] + mine) + b * L * h;
          for (int64_t l = 0; l < L; ++l) dst[l * h + e] = row[l * h + e];
        }
        continue;
      }
      float sum = 0.f;  // this rank's lanes, in lane order (MERGE_SUM: of round(residual_l + a_l))
      for (int64_t l = 0; l < L; ++l) {
        const float x = load_f32(row + l * h + e);
        sum += res != nullptr ? round_to<T>(load_f32(res + l * h + e) + x) : x;
      }
      for (int q = 0; q < R; ++q) reinterpret_cast<float*>(p.ranks->inbox[q] + mine)[b * h + e] = sum;
    }
  }
  push_done(p, op, step, n_items, smem);
}

// Every thread calls it before the first item of a finish: returns once every rank raised the
// channel's flag to this step's epoch (thread 0 spins on this rank's own flags, then a barrier
// and a system-scope acquire). Past p.wait_timeout_ticks it records the wait (op: the finish,
// count / target: the low 32 bits of the flag and the epoch) and traps.
__device__ __forceinline__ void wait_for_ranks(const PersistentDecodeParams& p, const Op& op, int32_t j, int step) {
  if (threadIdx.x == 0) {
    const int R = int(p.dims.lane_ranks), me = int(p.dims.lane_rank);
    const uint64_t epoch = rank_epoch(p, step);
    const uint64_t* flags = p.ranks->flags[me] + int64_t(op.comm) * R;
    for (int q = 0; q < R; ++q)
      if (!spin_until_sys(flags + q, epoch, p.wait_timeout_ticks))
        trap_timed_out(p.timeout, step, j, unsigned(load_acquire_sys(flags + q)), unsigned(epoch));
  }
  __syncthreads();
  fence_acquire_sys();
}

// The finish of LANE_SUM / LANE_MEAN / LANE_MERGE_SUM / LANE_ADD_PAST, item (b, part): every
// rank's parts of kRowChunk elements of row b. in: the lane-wide input (SUM, ADD_PAST: written
// in place); out: MEAN's and MERGE_SUM's hidden-wide output.
template <typename T>
__device__ void rank_finish_item(const PersistentDecodeParams& p, const Op& op, T* in, T* out, int b, int part,
                                 int step) {
  const int R = int(p.dims.lane_ranks), me = int(p.dims.lane_rank);
  const int64_t L = p.dims.n_lanes, h = p.dims.hidden;
  const ChannelParts cp = channel_parts(p, op.comm, step);
  const char* parts = p.ranks->inbox[me] + cp.offset;  // rank q's part at parts + q * cp.part
  int64_t e0, e1;
  row_chunk(h, part, e0, e1);
  T* row = in + b * L * h;
  for (int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
    if (op.op == int32_t(Opcode::kLaneAddPast)) {  // a_l + (round(sum of every lane's past) - past_l)
      float sum = 0.f;
      for (int q = 0; q < R; ++q) {
        const T* past = reinterpret_cast<const T*>(parts + q * cp.part) + b * L * h;
        for (int64_t l = 0; l < L; ++l) sum += load_f32(past + l * h + e);
      }
      const float all = round_to<T>(sum);
      const T* own = reinterpret_cast<const T*>(parts + me * cp.part) + b * L * h;
      for (int64_t l = 0; l < L; ++l) {
        const float others = round_to<T>(all - load_f32(own + l * h + e));
        store_f32(row + l * h + e, load_f32(row + l * h + e) + others);
      }
      continue;
    }
    float sum = 0.f;
    for (int q = 0; q < R; ++q) sum += reinterpret_cast<const float*>(parts + q * cp.part)[b * h + e];
    if (op.op == int32_t(Opcode::kLaneSum)) {  // every lane = the rounded sum
      for (int64_t l = 0; l < L; ++l) store_f32(row + l * h + e, sum);
    } else {  // MEAN: over every rank's lanes; MERGE_SUM: the sum
      store_f32(out + b * h + e, op.op == int32_t(Opcode::kLaneMean) ? sum / float(L * R) : sum);
    }
  }
}

// The finish of the logits' ALL_GATHER / ALL_REDUCE, item = sample chunk `chunk`: for every
// row, the chunk of LOGITS from every rank's parts (the slice's owner, or the sum in rank order
// rounded once). The kernel then runs SAMPLE's first phase over the chunk (sample_partial_tail,
// as after kOpLinearSamplePartial's last item of a chunk on one rank).
template <typename T>
__device__ void rank_logits_finish_item(const PersistentDecodeParams& p, const Op& op, T* logits, int64_t chunk,
                                        int step) {
  const int R = int(p.dims.lane_ranks), me = int(p.dims.lane_rank);
  const int64_t V = p.dims.vocab, w = V / R;
  const bool gather = op.op == int32_t(Opcode::kAllGather);
  const int64_t v0 = chunk * kSampleChunk, v1 = v0 + kSampleChunk < V ? v0 + kSampleChunk : V;
  const ChannelParts cp = channel_parts(p, op.comm, step);
  const char* parts = p.ranks->inbox[me] + cp.offset;  // rank q's part at parts + q * cp.part
#pragma unroll 1
  for (int b = 0; b < p.batch; ++b) {
    for (int64_t v = v0 + threadIdx.x; v < v1; v += blockDim.x) {
      if (gather) {
        const int q = int(v / w);
        logits[b * V + v] = reinterpret_cast<const T*>(parts + q * cp.part)[b * w + (v - q * w)];
      } else {
        float sum = 0.f;
        for (int q = 0; q < R; ++q) sum += reinterpret_cast<const float*>(parts + q * cp.part)[b * V + v];
        store_f32(logits + b * V + v, sum);
      }
    }
  }
  __syncthreads();  // the chunk's logits, written by every thread, before the summary reads them
}

}  // namespace kog::gpu::decode
