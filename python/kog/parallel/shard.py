"""One tensor-parallel rank's share of a lane model: its config view and its weights.

A model of L lanes on N ranks (N divides L): rank r holds lanes [r L/N, (r + 1) L/N) -- their
query and KV heads (lane l owns heads l H/L .. and KV heads l KV/L ..), their MLP units, their
norm scales -- and a full copy of the embedding. Its program is the model's program over its
lanes, with the cross-lane reductions done by the transport (kog.program.lanes). The KV cache
of a rank holds only its KV heads: nothing about attention crosses ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from kog.config import ModelConfig
from kog.errors import ModelLoadError
from kog.lane_config import LaneShard


def shard_config(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """Rank `rank` of `size`'s view of config: heads, intermediate and lanes divided by size.

    Raises:
        ModelLoadError: the model has no lanes, or size does not divide them.
    """
    lanes = config.lanes
    if lanes is None:
        raise ModelLoadError(f"tensor parallelism over lanes needs a lane model; {config.architecture} has none")
    if size < 1 or lanes.num_lanes % size or not 0 <= rank < size:
        raise ModelLoadError(f"tensor_parallel_size={size} must divide num_lanes={lanes.num_lanes} "
                             f"(rank {rank})")
    if config.shard.size != 1:
        raise ModelLoadError("config is already a rank's shard")
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size, intermediate_size=config.intermediate_size // size,
        lanes=dataclasses.replace(lanes, num_lanes=lanes.num_lanes // size), shard=LaneShard(rank, size))


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full checkpoint's tensors (kog.loader.laneformer layout) cut to config's shard
    (a shard_config view): every [L, ...] lane tensor to the rank's lanes; the LM head as its
    type needs (lane: the columns of the rank's lanes; vocab_parallel: its lanes' vocabulary
    rows; replicate: whole). Views, no copies."""
    lanes, shard = config.lanes, config.shard
    assert lanes is not None
    L_local, h = lanes.num_lanes, config.hidden_size
    lo, hi = shard.rank * L_local, (shard.rank + 1) * L_local
    lane_tensors = {"model.norm.scale"} | ({"lm_head.weight"} if lanes.lm_head_type == "vocab_parallel" else set())
    out = {}
    for name, w in weights.items():
        if name == "lm_head.linear.weight":  # [V, L h]: the rank's lanes' columns
            out[name] = w[:, lo * h:hi * h]
        elif name in lane_tensors or (name.startswith("model.layers.") and w.dim() >= 2):  # [L, ...]
            out[name] = w[lo:hi]
        else:  # the embedding, replicated norm weights [h], a replicated head
            out[name] = w
    return out
