// Opcodes and buffers of the model program (program.h): what both the CPU executor and the GPU
// persistent decode kernel run, built on the host once per model config (kog.program).
// Numeric values are part of the interface: kog.program.Opcode and kog.program.Buffer mirror
// them, and tests/cpu/test_schedule.py checks them against the values kog._C exports.
#pragma once
#include <cstdint>

namespace kog::schedule {

enum class Opcode : int32_t {
  kEmbed = 0,       // hidden[b] = embed_tokens[token[b]]
  kRmsNorm = 1,     // (residual += in, when fused) ; out = rmsnorm(residual or in) * weight
  kLinear = 2,      // out = in @ weight^T (+ bias)
  kQkNorm = 3,      // per-head RMSNorm of the q and k parts of qkv (Qwen3)
  kRope = 4,        // rotate the q and k parts of qkv at the step's positions
  kKvAppend = 5,    // write the k and v parts of qkv into this layer's paged cache
  kAttnDecode = 6,  // attn = paged attention of q over this layer's cache
  kSiluMul = 7,     // act = silu(gate) * up
  kSample = 8,      // tokens = sample(logits); the step's f32 logits output = logits
  kRouter = 9,      // route = top_k(softmax(in @ router^T)) per row: expert ids and weights (MoE)
  kMoeExperts = 10, // out = sum over the row's routed experts of weight * down(silu(gate) * up)(in)
  // Laneformer lanes (n_lanes > 1): a lane-wide buffer is [batch, n_lanes, hidden]; lane l of a
  // layer's attention / MLP output is a_l (program.h: ModelDims::n_lanes).
  kLaneScale = 11,   // in place: a_l *= sqrt(n_lanes) (no communication)
  kLaneSum = 12,     // in place: every lane = sum over lanes of a (all-reduce)
  kLaneGather = 13,  // LANE_HIST slot `slot` = in, all lanes (all-gather of a_l: read broadcast_delay layers later)
  kLaneAddPast = 14, // in place: a_l += sum over lanes of hist[slot] - hist[slot]_l (the delayed reduction)
  kLaneMean = 15,    // out [batch, hidden] = mean over the lanes of in (final norm, replicated head)
  kLaneMergeSum = 16,// out [batch, hidden] = sum over lanes of (residual + in) (pre-norm lane aggregation)
  // Collectives of a tensor-parallel rank's program (kog.parallel). No native executor runs them
  // yet: validate_program refuses them.
  kAllReduce = 17,   // in place: the sum of the buffer over the ranks
  kAllGather = 18,   // the ranks' buffers side by side
  kNumOpcodes = 19,
};

// Activation buffers of one decode step, each [batch, width] in the run dtype (widths:
// program.h buffer_width).
enum class Buffer : int32_t {
  kTokens = 0,    // [batch] int32: input token ids, then the sampled ones
  kHidden = 1,    // [batch, n_lanes hidden] (n_lanes = 1 but in Laneformer: one stream per lane)
  kResidual = 2,  // [batch, n_lanes hidden]: the residual stream
  kNormed = 3,    // [batch, n_lanes hidden]
  kQkv = 4,       // [batch, (n_q_heads + 2 n_kv_heads) head_dim]
  kAttn = 5,      // [batch, n_q_heads head_dim]
  kGateUp = 6,    // [batch, 2 intermediate]
  kAct = 7,       // [batch, intermediate]
  kLogits = 8,    // [batch, vocab] run dtype (SAMPLE copies it out as f32, on both backends)
  kRoute = 9,     // [batch, 2 (top_k + shared_slots)] 4-byte words: int32 expert ids, then their f32 weights (MoE)
  kMerged = 10,   // [batch, hidden]: the lanes merged into one stream before the LM head (Laneformer)
  kLaneHist = 11, // [batch, lane_hist_slots, n_lanes, hidden]: lane outputs kept for the delayed reduction
  kNumBuffers = 12,
};

}  // namespace kog::schedule
