"""The decode instruction schedule: one decode step of a Llama-family model as a list of
instructions with explicit dependencies.

Built once per model config on the host; the CPU executor runs it in order, the GPU persistent
kernel runs it across workgroups. Opcode and Buffer (kog.program.opcodes) mirror
csrc/schedule/opcodes.h.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from kog.program.opcodes import Buffer, Opcode


# A resource is an activation buffer or a layer's KV cache ("kv.<layer>").
Resource = Union[Buffer, str]


@dataclass(frozen=True)
class Instruction:
    opcode: Opcode
    layer: int                    # -1 for model-level instructions
    reads: tuple[Resource, ...]
    writes: tuple[Resource, ...]
    weights: tuple[str, ...]      # weight names (fused qkv_proj / gate_up_proj in the runner)
    deps: tuple[int, ...] = ()    # indices of earlier instructions that must complete first


@dataclass(frozen=True)
class ScheduleSpec:
    """The parts of a model config that shape the schedule."""

    n_layers: int
    qk_norm: bool = False          # Qwen3: RMSNorm per head on q and k
    qkv_bias: bool = False         # Qwen2: bias on the fused qkv projection
    tie_word_embeddings: bool = False


def build_decode_schedule(spec: ScheduleSpec) -> list[Instruction]:
    """Instructions of one decode step, in an order that is a valid sequential execution."""
    if spec.n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {spec.n_layers}")
    B = Buffer
    raw: list[tuple[Opcode, int, tuple, tuple, tuple]] = [
        (Opcode.EMBED, -1, (B.TOKENS,), (B.RESIDUAL,), ("model.embed_tokens.weight",)),
    ]
    for layer in range(spec.n_layers):
        p = f"model.layers.{layer}."
        kv = f"kv.{layer}"
        # The residual stream lives in RESIDUAL; each block's output lands in HIDDEN and is
        # added to it by the next fused RMSNorm. Layer 0 starts from the embedding alone.
        norm_in = (B.RESIDUAL,) if layer == 0 else (B.HIDDEN, B.RESIDUAL)
        norm_out = (B.NORMED,) if layer == 0 else (B.NORMED, B.RESIDUAL)
        qkv_w = (p + "self_attn.qkv_proj.weight",) + ((p + "self_attn.qkv_proj.bias",) if spec.qkv_bias else ())
        raw += [
            (Opcode.RMS_NORM, layer, norm_in, norm_out, (p + "input_layernorm.weight",)),
            (Opcode.LINEAR, layer, (B.NORMED,), (B.QKV,), qkv_w),
        ]
        if spec.qk_norm:
            raw.append((Opcode.QK_NORM, layer, (B.QKV,), (B.QKV,),
                        (p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight")))
        raw += [
            (Opcode.ROPE, layer, (B.QKV,), (B.QKV,), ()),
            (Opcode.KV_APPEND, layer, (B.QKV,), (kv,), ()),
            (Opcode.ATTN_DECODE, layer, (B.QKV, kv), (B.ATTN,), ()),
            (Opcode.LINEAR, layer, (B.ATTN,), (B.HIDDEN,), (p + "self_attn.o_proj.weight",)),
            (Opcode.RMS_NORM, layer, (B.HIDDEN, B.RESIDUAL), (B.NORMED, B.RESIDUAL),
             (p + "post_attention_layernorm.weight",)),
            (Opcode.LINEAR, layer, (B.NORMED,), (B.GATE_UP,), (p + "mlp.gate_up_proj.weight",)),
            (Opcode.SILU_MUL, layer, (B.GATE_UP,), (B.ACT,), ()),
            (Opcode.LINEAR, layer, (B.ACT,), (B.HIDDEN,), (p + "mlp.down_proj.weight",)),
        ]
    lm_head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    raw += [
        (Opcode.RMS_NORM, -1, (B.HIDDEN, B.RESIDUAL), (B.NORMED, B.RESIDUAL), ("model.norm.weight",)),
        (Opcode.LINEAR, -1, (B.NORMED,), (B.LOGITS,), (lm_head,)),
        (Opcode.SAMPLE, -1, (B.LOGITS,), (B.TOKENS,), ()),
    ]
    return _with_dependencies(raw)


def _with_dependencies(raw: list[tuple]) -> list[Instruction]:
    # deps of an instruction: the last writer of everything it reads or writes (RAW, WAW) and
    # every reader since that write of what it writes (WAR). Enough for any executor that
    # starts an instruction only after its deps complete to compute what the sequential order does.
    last_writer: dict[Resource, int] = {}
    readers_since_write: dict[Resource, list[int]] = {}
    out: list[Instruction] = []
    for i, (op, layer, reads, writes, weights) in enumerate(raw):
        deps: set[int] = set()
        for r in reads + writes:
            if r in last_writer:
                deps.add(last_writer[r])
        for w in writes:
            deps.update(readers_since_write.get(w, ()))
        deps.discard(i)
        for r in reads:
            readers_since_write.setdefault(r, []).append(i)
        for w in writes:
            last_writer[w] = i
            readers_since_write[w] = []
        out.append(Instruction(op, layer, reads, writes, weights, tuple(sorted(deps))))
    return out
