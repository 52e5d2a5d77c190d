"""The pre-norm decoder stack the Llama-like families share, as program blocks.

Each block appends its ops to a ProgramBuilder; a family function (kog.program.families)
chooses the blocks and their switches. A new kind of layer (MoE experts, Laneformer lanes, a
tensor-parallel shard's communication) is a new block here, used by the family that has it.

Buffer discipline: the residual stream lives in RESIDUAL; each block's output lands in HIDDEN
and is added to it by the next fused RMS_NORM. Layer 0 starts from the embedding alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from kog.lane_config import LaneConfig
from kog.program.opcodes import Buffer as B
from kog.program.opcodes import Opcode
from kog.program.program import Instruction, ProgramBuilder, Rows


@dataclass(frozen=True)
class DecoderSpec:
    """The switches of a Llama-like decoder that shape its program."""

    n_layers: int
    qk_norm: bool = False          # RMSNorm per head on q and k before RoPE (Qwen3)
    qkv_bias: bool = False         # bias on the fused qkv projection (Qwen2)
    tie_word_embeddings: bool = False
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is routed experts (moe_block)
    lanes: LaneConfig | None = None  # the tensor-parallel lane form (kog.parallel.shard.lane_form)
    sharded: bool = False            # a rank's share of the lanes (its head ends in a collective)
    split_head: bool = False         # a rank computes its vocabulary slice of a replicated head
    window: int = 0                  # > 0: every layer attends through this sliding window (Mistral)


def decoder_program(spec: DecoderSpec) -> list[Instruction]:
    """Embedding, n_layers of (attention, MLP) blocks, final norm, LM head and greedy sample."""
    if spec.n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {spec.n_layers}")
    p = ProgramBuilder()
    embed(p)
    n_lanes = spec.lanes.num_lanes if spec.lanes else 1
    for layer in range(spec.n_layers):
        attention_block(p, layer, qkv_bias=spec.qkv_bias, qk_norm=spec.qk_norm, lanes=n_lanes, window=spec.window)
        if spec.lanes:  # the lanes' partial o_proj sums, added up (an all-reduce across ranks)
            p.op(Opcode.LANE_SUM, layer, (B.HIDDEN,), (B.HIDDEN,))
        if layer in spec.moe_layers:
            moe_block(p, layer, placed=spec.sharded)
        else:
            mlp_block(p, layer, lanes=n_lanes)
        if spec.lanes:
            p.op(Opcode.LANE_SUM, layer, (B.HIDDEN,), (B.HIDDEN,))
    if spec.lanes:
        from kog.program.lanes import lane_lm_head

        lane_lm_head(p, spec.lanes, tied=spec.tie_word_embeddings, sharded=spec.sharded, split_head=spec.split_head)
    else:
        lm_head(p, tied=spec.tie_word_embeddings)
    return p.build()


def embed(p: ProgramBuilder) -> None:
    p.op(Opcode.EMBED, -1, (B.TOKENS,), (B.RESIDUAL,), ("model.embed_tokens.weight",))


def attention_block(p: ProgramBuilder, layer: int, qkv_bias: bool, qk_norm: bool, lanes: int = 1,
                    window: int = 0) -> None:
    """Pre-norm GQA attention over the paged cache; its output (o_proj) lands in HIDDEN.

    With lanes > 1 (Laneformer) the projections are lane projections: lane l's q/k/v heads come
    from lane l's normed stream, and o_proj maps lane l's heads to lane l of HIDDEN. window > 0:
    a sliding-window layer (each token sees its last `window` positions)."""
    w = f"model.layers.{layer}."
    kv = f"kv.{layer}"
    if layer == 0:
        p.op(Opcode.RMS_NORM, layer, (B.RESIDUAL,), (B.NORMED,), (w + "input_layernorm.weight",))
    else:
        p.op(Opcode.RMS_NORM, layer, (B.HIDDEN, B.RESIDUAL), (B.NORMED, B.RESIDUAL), (w + "input_layernorm.weight",))
    qkv_w = (w + "self_attn.qkv_proj.weight",) + ((w + "self_attn.qkv_proj.bias",) if qkv_bias else ())
    p.op(Opcode.LINEAR, layer, (B.NORMED,), (B.QKV,), qkv_w, lanes=lanes)
    if qk_norm:
        p.op(Opcode.QK_NORM, layer, (B.QKV,), (B.QKV,), (w + "self_attn.q_norm.weight", w + "self_attn.k_norm.weight"))
    p.op(Opcode.ROPE, layer, (B.QKV,), (B.QKV,))
    p.op(Opcode.KV_APPEND, layer, (B.QKV,), (kv,))
    # Each token attends to its sequence's cache up to its own position (decode: the newest token).
    p.op(Opcode.ATTN_DECODE, layer, (B.QKV, kv), (B.ATTN,), window=window)
    p.op(Opcode.LINEAR, layer, (B.ATTN,), (B.HIDDEN,), (w + "self_attn.o_proj.weight",), lanes=lanes)


def mlp_block(p: ProgramBuilder, layer: int, lanes: int = 1) -> None:
    """Pre-norm SwiGLU MLP; adds the attention output into RESIDUAL, its own lands in HIDDEN
    (with lanes > 1, each lane's from its own stream: lane projections)."""
    w = f"model.layers.{layer}."
    p.op(Opcode.RMS_NORM, layer, (B.HIDDEN, B.RESIDUAL), (B.NORMED, B.RESIDUAL), (w + "post_attention_layernorm.weight",))
    p.op(Opcode.LINEAR, layer, (B.NORMED,), (B.GATE_UP,), (w + "mlp.gate_up_proj.weight",), lanes=lanes)
    p.op(Opcode.SILU_MUL, layer, (B.GATE_UP,), (B.ACT,))
    p.op(Opcode.LINEAR, layer, (B.ACT,), (B.HIDDEN,), (w + "mlp.down_proj.weight",), lanes=lanes)


def moe_block(p: ProgramBuilder, layer: int, placed: bool = False) -> None:
    """Pre-norm mixture of experts: the router picks each token's experts (ROUTE), then only
    those experts' SwiGLU MLPs run, weighted and summed into HIDDEN (docs/ARCHITECTURE.md).
    placed: a tensor-parallel rank's block, which runs only its experts (`mlp.experts.ranks`)."""
    w = f"model.layers.{layer}."
    p.op(Opcode.RMS_NORM, layer, (B.HIDDEN, B.RESIDUAL), (B.NORMED, B.RESIDUAL), (w + "post_attention_layernorm.weight",))
    p.op(Opcode.ROUTER, layer, (B.NORMED,), (B.ROUTE,), (w + "mlp.gate.weight",))
    p.op(Opcode.MOE_EXPERTS, layer, (B.NORMED, B.ROUTE), (B.HIDDEN,),
         (w + "mlp.experts.gate_up_proj", w + "mlp.experts.down_proj") + ((w + "mlp.experts.ranks",) if placed else ()))


def lm_head(p: ProgramBuilder, tied: bool) -> None:
    """Final norm, LM head and greedy sampling, over the sampled rows only."""
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    p.op(Opcode.RMS_NORM, -1, (B.HIDDEN, B.RESIDUAL), (B.NORMED, B.RESIDUAL), ("model.norm.weight",), Rows.SAMPLED)
    p.op(Opcode.LINEAR, -1, (B.NORMED,), (B.LOGITS,), (head,), Rows.SAMPLED)
    p.op(Opcode.SAMPLE, -1, (B.LOGITS,), (B.TOKENS,), (), Rows.SAMPLED)
