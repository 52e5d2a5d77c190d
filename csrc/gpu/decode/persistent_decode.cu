// The persistent decode kernel's host side: GpuDecodeExecutor builds the params from the
// expanded program and launches the kernel (persistent_kernel.cuh) cooperatively.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gpu/decode/attention_item.cuh"
#include "schedule/moe_route.h"
#include "gpu/decode/executor.h"
#include "gpu/decode/sample_item.cuh"
#include "gpu/decode/weight_stage.cuh"

namespace kog::gpu::decode {

using schedule::Buffer;

namespace {

// The kernel for run dtype t; quant: with the GEMVs over GPU weight formats (bf16 runs only:
// persistent_kernel_quant.cu).
void* kernel_for(DType t, bool quant) { return quant ? persistent_kernel_quant(t) : persistent_kernel_float(t); }

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
    quant_ = quant_ || schedule::is_gpu_weight_format(o.w_type);
    if (schedule::is_gemv(o)) {
      KOG_CHECK(reinterpret_cast<uintptr_t>(o.w0) % 16 == 0 && reinterpret_cast<uintptr_t>(o.w2) % 16 == 0,
                "gpu decode: LINEAR and prologue norm weights must be 16-byte aligned");
      // An FP8 row is one 16-byte vector per 16 elements, a 4-bit row one per 32 (validate_program
      // checked k); Q4_K headers are read as 16-byte vectors.
      KOG_CHECK(o.w_type == schedule::kWeightRunDtype ||
                    (schedule::is_gpu_weight_format(o.w_type) && o.w_scale != nullptr),
                "gpu decode: a GEMV weight is neither the run dtype nor a GPU format (FP8, 4-bit) with its scales");
      KOG_CHECK(o.w_type != schedule::kWeightQ4K || reinterpret_cast<uintptr_t>(o.w_scale) % 16 == 0,
                "gpu decode: Q4_K headers must be 16-byte aligned");
      // A lane LINEAR's rows read x slices of width(in) / lanes: whole 16-byte vectors.
      KOG_CHECK(o.lanes <= 1 || (schedule::buffer_width(dims, o.in) / o.lanes) % vec == 0, "gpu decode: a lane LINEAR ",
                "reads slices of ", schedule::buffer_width(dims, o.in) / o.lanes, " elements, not a multiple of ", vec);
    }
  }
  const bool moe = dims.n_experts > 0;
  if (moe) {  // expand_gpu_program checked the slots and router rows against moe_route.h's limits
    KOG_CHECK(dims.expert_intermediate % vec == 0, "gpu decode: expert_intermediate ", dims.expert_intermediate,
              " must be a multiple of ", vec, " elements");
    for (const Op& o : ops)
      if (o.op == schedule::kOpMoeGateUp)
        KOG_CHECK(reinterpret_cast<uintptr_t>(o.w0) % 16 == 0 && reinterpret_cast<uintptr_t>(o.w1) % 16 == 0,
                  "gpu decode: expert weights must be 16-byte aligned");
  }
  KOG_CHECK(!quant_ || dims.dtype == DType::kBF16, "gpu decode: FP8 and 4-bit weights run with bfloat16 ",
            "activations, not ", dtype_name(dims.dtype), " (one kernel instantiation carries their GEMVs)");
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
  // NOTE: the device's copy drops the expert placements' host pointers (MoeScratch::expert_local
  // holds what the kernel needs of them)
  std::vector<Op> device_ops = ops;
  for (Op& o : device_ops) o.expert_ranks = nullptr;
  KOG_GPU_CHECK(gpuMemcpyAsync(program_, device_ops.data(), ops.size() * sizeof(Op), gpuMemcpyHostToDevice, nullptr));
  KOG_GPU_CHECK(gpuStreamSynchronize(nullptr));  // device_ops is freed when the constructor returns
  // next_linear[j]: the first staged GEMV op (LINEAR, its fused forms, the router, the experts'
  // GEMVs) at or after op j (n_ops: none), for weight staging.
  std::vector<int32_t> next_linear(ops.size());
  for (int32_t j = n_ops_ - 1, l = n_ops_; j >= 0; --j) {
    if (schedule::is_staged_gemv(ops[size_t(j)])) l = j;
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
  if (moe) {  // MoeScratch (params.h): P pairs at most
    const size_t P = size_t(kMaxBatch) * size_t(schedule::moe_slots(dims));
    const size_t H = size_t(dims.hidden), I = size_t(dims.expert_intermediate), e = size_t(elem);
    auto round = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
    const size_t E = size_t(dims.n_experts + dims.shared_slots);
    const size_t sizes[] = {round(size_t(kMaxBatch) * size_t(schedule::router_rows(dims)) * e), round(P * H * e),
                            round(P * I * e), round(P * H * e), round(4), round(P * 4), round((P + 1) * 4),
                            round(P * 4), round(P * 4), round(P * 4), round(E * 4)};
    size_t total_moe = 0;
    for (size_t b : sizes) total_moe += b;
    KOG_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&moe_scratch_), total_moe));
    char* at = moe_scratch_;
    auto next = [&](size_t i) {
      char* here = at;
      at += sizes[i];
      return here;
    };
    moe_.logits = next(0), moe_.x = next(1), moe_.act = next(2), moe_.y = next(3);
    moe_.n_groups = reinterpret_cast<int32_t*>(next(4));
    moe_.group_expert = reinterpret_cast<int32_t*>(next(5));
    moe_.group_start = reinterpret_cast<int32_t*>(next(6));
    moe_.pair_row = reinterpret_cast<int32_t*>(next(7));
    moe_.pair_weight = reinterpret_cast<float*>(next(8));
    moe_.row_pairs = reinterpret_cast<int32_t*>(next(9));
    // Expert parallelism (Op::expert_ranks, host memory: read here only): each expert's index in
    // this rank's stacks, ascending expert order, -1 for another rank's; one table for the model
    // (kog places experts per model), checked against every MoE layer's placement.
    int32_t* local = reinterpret_cast<int32_t*>(next(10));
    const int32_t* placed = nullptr;
    for (const Op& o : ops) {
      if (o.op != schedule::kOpMoeGateUp) continue;
      if (placed == nullptr) placed = o.expert_ranks;
      KOG_CHECK((o.expert_ranks == nullptr) == (placed == nullptr) &&
                    (placed == nullptr || std::equal(placed, placed + E, o.expert_ranks)),
                "gpu decode: MoE layer ", o.layer, " places its experts on other ranks than the first MoE layer");
    }
    moe_.expert_local = nullptr;
    if (placed != nullptr) {
      std::vector<int32_t> table(E, -1);
      for (size_t x = 0, n = 0; x < E; ++x)
        if (placed[x] == dims.lane_rank) table[x] = int32_t(n++);
      KOG_GPU_CHECK(gpuMemcpyAsync(local, table.data(), E * 4, gpuMemcpyHostToDevice, nullptr));
      KOG_GPU_CHECK(gpuStreamSynchronize(nullptr));  // table is freed at the end of this block
      moe_.expert_local = local;
    }
  }
  // per-op counters, exit_count, the attention group counts, the sample chunk counts, then the
  // MoE router's item count
  const size_t counter_bytes = (size_t(kMaxLoopSteps) * ops.size() + 1 + size_t(kMaxBatch) * size_t(dims.n_kv_heads) +
                                size_t(sample_chunks(dims.vocab)) + 1) * sizeof(unsigned);
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
    KOG_GPU_CHECK(gpuFuncGetAttributes(&attr, kernel_for(dims.dtype, quant_)));
    KOG_CHECK_KIND(size_t(kStageSmemBytes) + attr.sharedSizeBytes <= prop.sharedMemPerBlockOptin, kBackend,
                   "gpu decode: the kernel needs ", kStageSmemBytes, " + ", attr.sharedSizeBytes,
                   " bytes of shared memory per block, the device gives ", prop.sharedMemPerBlockOptin);
#endif
    KOG_GPU_CHECK(gpuFuncSetAttribute(kernel_for(dims.dtype, quant_), gpuFuncAttributeMaxDynamicSharedMemorySize,
                                      kStageSmemBytes));
  }
  KOG_GPU_CHECK(
      gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_for(dims.dtype, quant_), kThreads, kStageSmemBytes));
  KOG_CHECK_KIND(per_sm > 0, kBackend, "gpu decode: the kernel cannot be resident on this device");
  grid_ = full_grid_ = prop.multiProcessorCount * std::min(per_sm, kBlocksPerMultiprocessor);

  if (dims.lane_ranks > 1) {  // the channels' places, push counts and the exchange (set_ranks fills it)
    KOG_CHECK(dims.lane_ranks <= kMaxRanks, "gpu decode: ", dims.lane_ranks, " tensor-parallel ranks (at most ",
              kMaxRanks, ")");
    comm_ = schedule::comm_layout(ops, dims, kMaxBatch);
    // [offsets | parts | push counts (zero) | the RankExchange (set_ranks)]
    const size_t n = comm_.part.size();
    const size_t bytes = 2 * n * sizeof(int64_t) + (n * sizeof(unsigned) + 255) / 256 * 256 + sizeof(RankExchange);
    KOG_GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&comm_arrays_), bytes));
    KOG_GPU_CHECK(gpuMemsetAsync(comm_arrays_, 0, bytes, nullptr));
    exchange_.offset = reinterpret_cast<const int64_t*>(comm_arrays_);
    exchange_.part = exchange_.offset + n;
    exchange_.push_counts = reinterpret_cast<unsigned*>(comm_arrays_ + 2 * n * sizeof(int64_t));
    exchange_.parity_bytes = comm_.parity_bytes;
    KOG_GPU_CHECK(gpuMemcpyAsync(const_cast<int64_t*>(exchange_.offset), comm_.offset.data(), n * sizeof(int64_t),
                                 gpuMemcpyHostToDevice, nullptr));
    KOG_GPU_CHECK(gpuMemcpyAsync(const_cast<int64_t*>(exchange_.part), comm_.part.data(), n * sizeof(int64_t),
                                 gpuMemcpyHostToDevice, nullptr));
    ranks_ = reinterpret_cast<RankExchange*>(comm_arrays_ + bytes - sizeof(RankExchange));
    KOG_GPU_CHECK(gpuStreamSynchronize(nullptr));
  }

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

void GpuDecodeExecutor::set_ranks(const std::vector<uintptr_t>& inboxes, const std::vector<uintptr_t>& flags) {
  const size_t R = size_t(d_.lane_ranks);
  KOG_CHECK(R > 1, "gpu decode: set_ranks on a program of one rank");
  KOG_CHECK(inboxes.size() == R && flags.size() == R, "gpu decode: set_ranks takes ", R, " inboxes and ", R,
            " flag arrays, got ", inboxes.size(), " and ", flags.size());
  RankExchange x = exchange_;  // the layout arrays the constructor placed, and the ranks' memory
  for (size_t q = 0; q < R; ++q) {
    KOG_CHECK(inboxes[q] != 0 && flags[q] != 0 && inboxes[q] % 256 == 0 && flags[q] % 8 == 0,
              "gpu decode: rank ", q, "'s inbox (256-byte aligned) or flags (8-byte aligned) address is bad");
    x.inbox[q] = reinterpret_cast<char*>(inboxes[q]);
    x.flags[q] = reinterpret_cast<uint64_t*>(flags[q]);
  }
  KOG_GPU_CHECK(gpuMemcpyAsync(ranks_, &x, sizeof(x), gpuMemcpyHostToDevice, nullptr));
  KOG_GPU_CHECK(gpuStreamSynchronize(nullptr));
  ranks_set_ = true;
}

void GpuDecodeExecutor::set_max_grid(int max_grid) {
  KOG_CHECK(max_grid >= 0, "gpu decode: max_grid ", max_grid);
  grid_ = max_grid == 0 ? full_grid_ : std::min(max_grid, full_grid_);
}

GpuDecodeExecutor::~GpuDecodeExecutor() {
  // Frees cannot throw out of a destructor: errors here are dropped.
  (void)gpuFreeHost(timeout_host_);
  (void)gpuFree(comm_arrays_);
  (void)gpuFree(partials_);
  (void)gpuFree(sample_scratch_);
  (void)gpuFree(moe_scratch_);
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
  KOG_CHECK(d_.lane_ranks == 1 || ranks_set_, "gpu decode: tensor-parallel rank ", d_.lane_rank, " of ",
            d_.lane_ranks, " runs only after set_ranks");
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
  p.moe = moe_;
  p.moe.route_count = p.sample_chunk_counts + size_t(sample_chunks(d_.vocab));
  p.timeout = timeout_device_;
  p.wait_timeout_ticks = wait_timeout_ticks_;
  p.debug_skip_signal_op = debug_skip_signal_op_;
  p.ranks = ranks_;
  p.step_base = step_base_;
  p.vocab_slice_rows = d_.vocab / d_.lane_ranks;
  step_base_ += uint64_t(s.n_steps);

  void* args[] = {&p};
  KOG_GPU_CHECK(gpuLaunchCooperativeKernel(kernel_for(d_.dtype, quant_), dim3(unsigned(grid_)), dim3(kThreads), args,
                                           size_t(kStageSmemBytes), as_stream(stream)));
}

}  // namespace kog::gpu::decode
