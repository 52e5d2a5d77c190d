"""The native decode step: kog._C.DecodeExecutor built from the decode schedule.

Python resolves each instruction of the family's program (kog.program.program_for) to raw operands (buffers,
weight addresses); C++ runs the whole program for the batch in one call, GIL released. The
executor points into `weights` and the KV tensor: both must stay alive and never move, which
the owner (ModelRunner) guarantees by keeping them for its lifetime.
"""

from __future__ import annotations

import torch

from kog import _C
from kog.config import ModelConfig
from kog.ops import _DTYPE_CODE
from kog.program import Buffer, Instruction, Opcode, program_for


def schedule_for(config: ModelConfig) -> list[Instruction]:
    return program_for(config)


def resolve(ins: Instruction, weights: dict[str, torch.Tensor]) -> tuple[int, int, int, int, int, int, int]:
    """(opcode, layer, in, residual, out, w0, w1) of one instruction, as DecodeExecutor takes it.

    RMS_NORM reads (x,) or (x, residual): with a residual the kernel adds x into it and
    normalizes the sum. Attention and KV_APPEND name the layer's cache, which the executor
    addresses by layer; only their activation buffers are passed here.
    """
    bufs_in = [r for r in ins.reads if isinstance(r, Buffer)]
    bufs_out = [w for w in ins.writes if isinstance(w, Buffer)]
    residual = -1
    if ins.opcode == Opcode.RMS_NORM and len(bufs_in) == 2:
        residual = int(bufs_in[1])
    ptrs = [weights[name].data_ptr() for name in ins.weights] + [0, 0]
    return (int(ins.opcode), ins.layer, int(bufs_in[0]) if bufs_in else -1, residual,
            int(bufs_out[0]) if bufs_out else -1, ptrs[0], ptrs[1])


def build_executor(config: ModelConfig, weights: dict[str, torch.Tensor], kv: torch.Tensor,
                   block_size: int, inv_freq: torch.Tensor) -> _C.DecodeExecutor:
    """Args:
        config: the model.
        weights: prepared weights (kog.models.weights.prepare_weights), contiguous, run dtype.
        kv: [num_layers, num_blocks, 2, n_kv_heads, block_size, head_dim] in the run dtype.
        block_size: tokens per KV block.
        inv_freq: [rotary_dim / 2] float32 RoPE frequencies.
    """
    dtype = weights["model.embed_tokens.weight"].dtype
    if kv.dtype != dtype or not kv.is_contiguous():
        raise ValueError(f"kv cache must be contiguous {dtype}, got {kv.dtype}")
    dims = dict(
        n_layers=config.num_hidden_layers, hidden=config.hidden_size,
        n_q_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim, intermediate=config.intermediate_size, vocab=config.vocab_size,
        rms_eps=config.rms_norm_eps, attn_scale=config.head_dim ** -0.5, rope_neox=True,
        dtype=_DTYPE_CODE[dtype],
    )
    program = [resolve(ins, weights) for ins in schedule_for(config)]
    return _C.DecodeExecutor(dims, kv.data_ptr(), kv.shape[1], block_size,
                             inv_freq.float().tolist(), program)
