"""The native decode step: kog._C.DecodeExecutor built from the model program.

Python lowers each op of the program (kog.program: opcode, layer, reads, writes, weight names,
deps) to a kog._C.Op with raw operands (buffer ids, weight addresses, dep indices); C++ runs the
whole program for the batch in one call, GIL released. `model_dims` is the one place the model's
shape (kog._C.ModelDims) is built from the config; the CPU executor and the GPU kernel
(kog.models.gpu_decode) both take it. The executor points into `weights` and the KV tensor:
both must stay alive and never move, which the owner (ModelRunner) guarantees by keeping them
for its lifetime.
"""

from __future__ import annotations

import torch

from kog import _C
from kog.config import ModelConfig
from kog.errors import InvalidRequest
from kog.fp8 import Fp8Weight
from kog.int4 import Int4Weight
from kog.ops import DTYPE_CODE, kv_cache_dtype_ok
from kog.program import Buffer, Instruction, Opcode, program_for
from kog.program.families import ROPE_NEOX
from kog.program.program import slot_of
from kog.quantized import QuantizedWeight


def model_dims(config: ModelConfig, dtype: torch.dtype) -> _C.ModelDims:
    """The model's shape as both executors take it (validated in C++: InvalidRequest if bad).

    Args:
        config: the model.
        dtype: the run dtype of weights, activations and the KV cache.
    """
    if config.architecture not in ROPE_NEOX:
        raise InvalidRequest(f"no decode program for architecture {config.architecture!r}")
    if dtype not in DTYPE_CODE:
        raise InvalidRequest(f"run dtype {dtype} has no kog dtype code")
    return _C.ModelDims(
        n_layers=config.num_hidden_layers, hidden=config.hidden_size,
        n_q_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, intermediate=config.intermediate_size, vocab=config.vocab_size,
        rotary_dim=config.head_dim, rms_eps=config.rms_norm_eps, attn_scale=config.head_dim ** -0.5,
        rope_neox=ROPE_NEOX[config.architecture], dtype=DTYPE_CODE[dtype],
        n_experts=config.num_experts if config.is_moe else 0,
        top_k=config.num_experts_per_tok if config.is_moe else 0,
        expert_intermediate=config.moe_intermediate_size if config.is_moe else 0,
        norm_topk=config.norm_topk_prob, shared_slots=config.shared_expert_slots if config.is_moe else 0,
        **lane_dims(config))


def lane_dims(config: ModelConfig) -> dict:
    """ModelDims' lane fields (n_lanes, lane_norm_weights, lane_hist_slots); one lane otherwise."""
    lanes = config.lanes
    if lanes is None:
        return {}
    return dict(n_lanes=lanes.num_lanes, lane_norm_weights=not lanes.replicated_rmsn_scale,
                lane_hist_slots=2 * lanes.hist_slots_per_kind, lane_ranks=config.shard.size,
                lane_rank=config.shard.rank)


def schedule_for(config: ModelConfig) -> list[Instruction]:
    return program_for(config)


def lower(ins: Instruction, weights: dict[str, torch.Tensor]) -> _C.Op:
    """One program op with raw operands, as both executors take it.

    RMS_NORM reads (x,) or (x, residual): with a residual the kernel adds x into it and
    normalizes the sum. Attention and KV_APPEND name the layer's cache, which the executors
    address by layer; only their activation buffers are passed here. deps are indices into the
    same program.
    """
    bufs_in = [r for r in ins.reads if isinstance(r, Buffer)]
    bufs_out = [w for w in ins.writes if isinstance(w, Buffer)]
    residual = -1
    if ins.opcode in (Opcode.RMS_NORM, Opcode.LANE_MERGE_SUM) and len(bufs_in) == 2:
        residual = int(bufs_in[1])
    # A lane-history slot ("lanes.hist.<slot>") is a slice of LANE_HIST the op names by index.
    slots = [s for s in map(slot_of, ins.reads + ins.writes) if s is not None]
    if ins.opcode == Opcode.LANE_GATHER:
        bufs_out = [Buffer.LANE_HIST]
    ptrs = [weights[name].data_ptr() for name in ins.weights] + [0, 0]
    # Each weight's storage: a ggml type for a QuantizedWeight (EMBED, LINEAR, MOE_EXPERTS' two
    # stacks), FP8 with its row scales for an Fp8Weight and a 4-bit GPU format with its group
    # scales for an Int4Weight (LINEAR; the GPU kernel only), else the run dtype.
    w_type, w1_type = ([w.qtype if isinstance(w, QuantizedWeight) else _C.WEIGHT_RUN_DTYPE
                        for w in (weights[n] for n in ins.weights)] + [_C.WEIGHT_RUN_DTYPE] * 2)[:2]
    w0 = weights[ins.weights[0]] if ins.weights else None
    w_scale = 0
    if isinstance(w0, Fp8Weight):
        w_type, w_scale = _C.WEIGHT_FP8, w0.scale.data_ptr()
    elif isinstance(w0, Int4Weight):
        w_type, w_scale = w0.kind, w0.groups.data_ptr()
    return _C.Op(int(ins.opcode), ins.layer, int(bufs_in[0]) if bufs_in else -1, residual,
                 int(bufs_out[0]) if bufs_out else -1, ptrs[0], ptrs[1], sorted(ins.deps),
                 w_type=w_type, w1_type=w1_type, lanes=ins.lanes, slot=slots[0] if slots else -1,
                 window=ins.window, vocab_slice=int(ins.vocab_slice),
                 expert_ranks=ptrs[2] if ins.opcode == Opcode.MOE_EXPERTS and len(ins.weights) > 2 else 0,
                 w_scale=w_scale)


def lower_program(program: list[Instruction], weights: dict[str, torch.Tensor]) -> list[_C.Op]:
    """Every op of a program, lowered (see lower)."""
    return [lower(ins, weights) for ins in program]


def build_executor(config: ModelConfig, weights: dict[str, torch.Tensor], kv: torch.Tensor,
                   block_size: int, inv_freq: torch.Tensor,
                   program: list[Instruction] | None = None, dtype: torch.dtype | None = None) -> _C.DecodeExecutor:
    """Args:
        config: the model.
        weights: prepared weights (kog.models.weights.prepare_weights), contiguous, run dtype
            (QuantizedWeight matrices: their ggml type goes into each op's w_type).
        kv: [num_layers, num_blocks, 2, n_kv_heads, block_size, head_dim] in the run dtype, or
            float16 / bfloat16 under a float32 run dtype (a narrower KV cache).
        block_size: tokens per KV block.
        inv_freq: [rotary_dim / 2] float32 RoPE frequencies.
        program: the ops to run (default: schedule_for(config)); any topological order of them.
        dtype: the run dtype (default kv's; quantized matrices run with f32 activations: validate_program).
    """
    dtype = kv.dtype if dtype is None else dtype
    float_weights = [w for w in weights.values()
                     if not isinstance(w, (QuantizedWeight, Fp8Weight, Int4Weight)) and w.is_floating_point()]
    if any(w.dtype != dtype for w in float_weights):
        raise InvalidRequest(f"the float weights must be in the run dtype {dtype}")
    if not kv.is_contiguous() or not kv_cache_dtype_ok(dtype, kv.dtype):
        raise InvalidRequest(f"kv cache must be contiguous and in the run dtype {dtype} (or float16 / bfloat16 "
                             f"under float32), got {kv.dtype}")
    ops = lower_program(schedule_for(config) if program is None else program, weights)
    return _C.DecodeExecutor(model_dims(config, dtype), kv.data_ptr(), kv.shape[1], block_size,
                             inv_freq.float().tolist(), ops, DTYPE_CODE[kv.dtype])
