"""Laneformer's program: the Llama blocks over per-lane streams, plus the lane reductions.

    program = laneformer_program(config)     # config.lanes: kog.lane_config.LaneConfig

HIDDEN, RESIDUAL and NORMED hold one stream per lane ([rows, lanes, hidden]); the projections
are lane projections (Instruction.lanes); after each attention and MLP block the lanes'
outputs are combined as config.lanes.reduce_mode says. A layer whose output a later layer
reduces with is first copied to a LANE_HIST slot (LANE_GATHER): that op is the all-gather a
lane rank issues at once and the reducing op waits for broadcast_delay layers later, so the
dependency is exactly that slot (kog.program.program.hist_slot), nothing in between.
"""

from __future__ import annotations

from kog.config import ModelConfig
from kog.lane_config import LaneConfig
from kog.program.decoder import attention_block, embed, mlp_block
from kog.program.opcodes import Buffer as B
from kog.program.opcodes import Opcode
from kog.program.program import Instruction, ProgramBuilder, Rows, hist_slot

ATTENTION, MLP = 0, 1  # kinds of kept outputs (LaneConfig.hist_slot)


def laneformer_program(config: ModelConfig) -> list[Instruction]:
    lanes, n = config.lanes, config.num_hidden_layers
    assert lanes is not None
    p = ProgramBuilder()
    embed(p)  # every lane starts from the embedding
    for layer in range(n):
        window = config.sliding_window if config.sliding_window and lanes.windowed(layer, n) else 0
        attention_block(p, layer, qkv_bias=False, qk_norm=False, lanes=lanes.num_lanes, window=window)
        reduce_lanes(p, lanes, layer, ATTENTION, n)
        mlp_block(p, layer, lanes=lanes.num_lanes)
        reduce_lanes(p, lanes, layer, MLP, n)
    lane_lm_head(p, lanes, tied=config.tie_word_embeddings, sharded=config.shard.size > 1,
                 split_head=splits_replicated_head(config))
    return p.build()


def splits_replicated_head(config: ModelConfig) -> bool:
    """True when a tensor-parallel rank computes only its vocabulary slice of a replicated head
    (the ranks divide the vocabulary)."""
    lanes = config.lanes
    return (lanes is not None and lanes.lm_head_type == "replicate" and config.shard.size > 1
            and config.vocab_size % config.shard.size == 0)


def reduce_lanes(p: ProgramBuilder, lanes: LaneConfig, layer: int, kind: int, n_layers: int) -> None:
    """Combines the lanes' outputs in HIDDEN in place (keeping them first when a later layer
    needs them); the next RMS_NORM adds HIDDEN into RESIDUAL."""
    if lanes.keeps_output(layer, n_layers):
        p.op(Opcode.LANE_GATHER, layer, (B.HIDDEN,), (hist_slot(lanes.hist_slot(kind, layer)),))
    mode = lanes.reduce_mode(layer)
    if mode == "scale":
        p.op(Opcode.LANE_SCALE, layer, (B.HIDDEN,), (B.HIDDEN,))
    elif mode == "sum":
        p.op(Opcode.LANE_SUM, layer, (B.HIDDEN,), (B.HIDDEN,))
    else:
        past = hist_slot(lanes.hist_slot(kind, layer - lanes.broadcast_delay))
        p.op(Opcode.LANE_ADD_PAST, layer, (B.HIDDEN, past), (B.HIDDEN,))


def lane_lm_head(p: ProgramBuilder, lanes: LaneConfig, tied: bool, sharded: bool = False,
                 split_head: bool = False) -> None:
    """Final norm, lane merge and LM head (config.lanes.lm_head_type), greedy sample; sampled rows.

    On a tensor-parallel rank (sharded) the lane ops reduce over every rank's lanes, a "lane"
    head's product over the rank's lanes is a partial sum (ALL_REDUCE) and a "vocab_parallel"
    head's the rank's slice of the vocabulary (ALL_GATHER). A replicated head is split the same
    way when the ranks divide the vocabulary (split_head: each rank computes its slice of the
    vocabulary from the merged stream, `lm_head.weight` its rows -- for a tied head a copy of
    the embedding's, kog.models.weights), else computed whole on every rank."""
    head = "lm_head.weight" if split_head or not tied else "model.embed_tokens.weight"
    s = Rows.SAMPLED

    def merged_head() -> None:
        p.op(Opcode.LINEAR, -1, (B.MERGED,), (B.LOGITS,), (head,), s, vocab_slice=split_head)
        if split_head:
            p.op(Opcode.ALL_GATHER, -1, (B.LOGITS,), (B.LOGITS,), (), s)

    if lanes.pre_norm_lane_agg:  # sum of the lanes' residual streams, then one norm
        p.op(Opcode.LANE_MERGE_SUM, -1, (B.HIDDEN, B.RESIDUAL), (B.MERGED,), (), s)
        p.op(Opcode.RMS_NORM, -1, (B.MERGED,), (B.MERGED,), ("model.norm.weight",), s)
        merged_head()
    else:
        p.op(Opcode.RMS_NORM, -1, (B.HIDDEN, B.RESIDUAL), (B.NORMED, B.RESIDUAL), ("model.norm.weight",), s)
        if lanes.lm_head_type == "replicate":
            p.op(Opcode.LANE_MEAN, -1, (B.NORMED,), (B.MERGED,), (), s)
            merged_head()
        elif lanes.lm_head_type == "lane":  # [vocab, lanes hidden]: the lanes concatenated
            p.op(Opcode.LINEAR, -1, (B.NORMED,), (B.LOGITS,), (head,), s)
            if sharded:
                p.op(Opcode.ALL_REDUCE, -1, (B.LOGITS,), (B.LOGITS,), (), s)
        else:  # vocab_parallel: lane l's stream gives vocabulary rows l V/L .. (l + 1) V/L
            p.op(Opcode.LINEAR, -1, (B.NORMED,), (B.LOGITS,), (head,), s, lanes=lanes.num_lanes, vocab_slice=sharded)
            if sharded:
                p.op(Opcode.ALL_GATHER, -1, (B.LOGITS,), (B.LOGITS,), (), s)
    p.op(Opcode.SAMPLE, -1, (B.LOGITS,), (B.TOKENS,), (), s)
