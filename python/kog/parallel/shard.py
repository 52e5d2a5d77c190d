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
from kog.errors import InvalidRequest, ModelLoadError
from kog.lane_config import LaneConfig, LaneShard
from kog.loader.moe import is_expert_stack
from kog.models.weights import rank_routed_experts
from kog.quantized import QuantizedWeight
from kog.program.lanes import splits_replicated_head


def lane_form(config: ModelConfig, lanes: int) -> ModelConfig:
    """A model (llama, mistral, qwen2, qwen3; the MoE families with their experts placed on the
    ranks, which they must then be split over: one lane per rank) as `lanes` lanes: lane l computes heads
    l H/lanes .. and MLP units l I/lanes .. from its own copy of the residual stream, and the
    lanes' partial o_proj / down_proj sums are added after every block -- Megatron-style
    tensor parallelism, written in the program's lane ops so that a rank runs its lanes. The
    same function of the tokens as config (up to the order of the partial sums). The head is
    vocabulary-parallel when lanes divide the vocabulary (and the head is not tied), else
    replicated. With fewer KV heads than lanes (lanes a multiple of them), each KV head is
    replicated over lanes / num_key_value_heads consecutive lanes (LaneConfig.kv_repeat: the lane
    form has one KV head per lane; a rank reads its stored head and repeats it, replicate_kv_heads).
    A Laneformer is returned as is: its lanes are already the parallel axis.

    Raises:
        ModelLoadError: a family without a lane form, lanes not dividing heads / units, or KV
            heads that neither divide into the lanes nor divide them.
    """
    if config.architecture == "laneformer_tp":
        return config
    kv, repeat = config.num_key_value_heads, 1
    if lanes >= 1 and kv % lanes:
        if lanes % kv:
            raise ModelLoadError(f"{lanes} lanes / tensor-parallel ranks: num_key_value_heads={kv} neither splits "
                                 f"evenly over them nor divides them (to be replicated)")
        repeat = lanes // kv
    head = "vocab_parallel" if config.vocab_size % lanes == 0 and not config.tie_word_embeddings else "replicate"
    return dataclasses.replace(config, num_key_value_heads=kv * repeat,
                               lanes=LaneConfig(num_lanes=lanes, broadcast_delay=0, lm_head_type=head,
                                                kv_repeat=repeat))


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
        num_key_value_heads=config.num_key_value_heads // size,
        # the dense MLPs' units (a model whose every MLP is experts, Mixtral, has none to split)
        intermediate_size=config.intermediate_size // (1 if len(config.moe_layers) == config.num_hidden_layers else size),
        lanes=dataclasses.replace(lanes, num_lanes=lanes.num_lanes // size), shard=LaneShard(rank, size))


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full checkpoint's tensors cut to config's shard (a shard_config view), as
    shard_index says: float tensors as views, GGUF blocks (QuantizedWeight) by whole byte rows,
    or by whole blocks of columns (copies).

    Raises:
        InvalidRequest: an FP8 matrix (not split over ranks), or a column split that cuts a
            quantized block (kog.quantized.QuantizedWeight.take).
    """
    out = {}
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            index = shard_index(config, name, 2)
            if index is not None and is_expert_stack(name):
                per = w.shape[0] // config.num_experts  # [E n, k] blocks: the experts' byte rows
                index = (slice(index[0].start * per, index[0].stop * per),)
            try:
                out[name] = w if index is None else w.take(index)
            except InvalidRequest as e:
                raise InvalidRequest(f"{name}: its {config.shard.size}-way split: {e}") from None
            continue
        if not isinstance(w, torch.Tensor):
            raise InvalidRequest(f"tensor parallelism needs float or GGUF-block weights ({name} is "
                                 f"{type(w).__name__}): load the model with dtype='float32' or 'bfloat16'")
        index = shard_index(config, name, w.dim())
        out[name] = w if index is None else w[index]
    return replicate_kv_heads(config, out)


_KV_PROJECTIONS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_proj.bias",
                   "self_attn.v_proj.bias")


def replicate_kv_heads(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A lane form with replicated KV heads (LaneConfig.kv_repeat > 1): the rank's k/v projection
    rows as shard_index read them (its stored heads) -> one head per local lane (copies). Every
    other tensor, and every other config, as given."""
    lanes = config.lanes
    if lanes is None or lanes.kv_repeat == 1:
        return weights
    rep, hd, local = lanes.kv_repeat, config.head_dim, config.num_key_value_heads
    first = config.shard.rank * local  # the rank's first (replicated) KV head
    heads = torch.tensor([(first + i) // rep - first // rep for i in range(local)])  # into the stored slice
    out = dict(weights)
    for name, w in weights.items():
        if name.startswith("model.layers.") and name.endswith(_KV_PROJECTIONS):
            if isinstance(w, QuantizedWeight):  # whole byte rows, head_dim of them a head
                out[name] = w.with_data(w.data.reshape(-1, hd, w.data.shape[1])[heads].reshape(local * hd, -1))
            else:
                out[name] = w.reshape(-1, hd, *w.shape[1:])[heads].reshape(local * hd, *w.shape[1:])
    return out


def shard_index(config: ModelConfig, name: str, ndim: int) -> tuple[slice, ...] | None:
    """The part of stored tensor `name` (of ndim dims) that config's shard keeps, as an index
    (None: all of it). The loader reads only that part of a safetensors file.

    Laneformer (kog.loader.laneformer layout): every [L, ...] lane tensor to the rank's lanes;
    the LM head as its type needs (lane: the columns of the rank's lanes; vocab_parallel: its
    lanes' vocabulary rows; replicate: whole). Other families (HF Llama names): the rank's rows
    of q/k/v (and biases) and gate/up, its columns of o_proj and down_proj, its vocabulary rows of
    a vocabulary-parallel head; of the stacked experts, the rank's routed ones
    (kog.models.weights.rank_routed_experts); routers and shared experts whole (expert_ranks
    places the shared expert's slices)."""
    lanes, shard = config.lanes, config.shard
    assert lanes is not None
    if shard.size == 1:
        return None
    if config.architecture == "laneformer_tp":
        L_local, h = lanes.num_lanes, config.hidden_size
        lo, hi = shard.rank * L_local, (shard.rank + 1) * L_local
        if name == "lm_head.linear.weight":  # [V, L h]: the rank's lanes' columns
            return (slice(None), slice(lo * h, hi * h))
        if name == "lm_head.weight" and splits_replicated_head(config):  # [V, h]: the rank's vocabulary rows
            n = config.vocab_size // shard.size
            return (slice(shard.rank * n, (shard.rank + 1) * n),)
        lane_tensors = {"model.norm.scale"} | ({"lm_head.weight"} if lanes.lm_head_type == "vocab_parallel" else set())
        if name in lane_tensors or (name.startswith("model.layers.") and ndim >= 2):  # [L, ...]
            return (slice(lo, hi),)
        return None  # the embedding, replicated norm weights [h], a replicated head
    r, hd = shard.rank, config.head_dim
    q, kv, units = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": units, "up_proj": units}  # per rank
    cols = {"o_proj": q, "down_proj": units}
    if is_expert_stack(name):  # [E, ...]: the rank's routed experts
        mine = rank_routed_experts(config)
        return (slice(mine.start, mine.stop),)
    expert = "shared_expert" in name or ".experts." in name
    kind = name.split(".")[-2] if name.startswith("model.layers.") and not expert else None
    if kind in ("k_proj", "v_proj") and lanes.kv_repeat > 1:  # the stored heads of the rank's replicated ones
        local = config.num_key_value_heads
        return (slice(r * local // lanes.kv_repeat * hd, (((r + 1) * local - 1) // lanes.kv_repeat + 1) * hd),)
    if kind in rows:
        return (slice(r * rows[kind], (r + 1) * rows[kind]),)
    if kind in cols:
        return (slice(None), slice(r * cols[kind], (r + 1) * cols[kind]))
    if name == "lm_head.weight" and (lanes.lm_head_type == "vocab_parallel" or splits_replicated_head(config)):
        n = config.vocab_size // shard.size
        return (slice(r * n, (r + 1) * n),)
    return None
