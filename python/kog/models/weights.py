"""Weights laid out for the runner: fused projections, contiguous, in the run dtype.

The loader hands HF names; the runner wants one GEMV per stage of a layer, so q/k/v become
`qkv_proj` ([q; k; v] rows) and gate/up become `gate_up_proj` ([gate; up] rows) -- the names the
decode schedule (kog.program) refers to.
"""

from __future__ import annotations

from typing import Union

import torch

from kog.config import ModelConfig
from kog.errors import ModelLoadError
from kog.fp8 import Fp8Weight
from kog.fp8 import cat_rows as cat_fp8_rows
from kog.models.moe_weights import SHARED, moe_layer
from kog.program.lanes import splits_replicated_head
from kog.quantized import QuantizedWeight, can_pack, cat_rows, pack_rows

Tensor = Union[torch.Tensor, QuantizedWeight, Fp8Weight]


def prepare_weights(config: ModelConfig, weights: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Fuses and converts a checkpoint's weights once, at load.

    Args:
        config: the model's config.
        weights: HF names -> tensors (kog.loader.LoadedModel.weights).
        dtype: run dtype (float32, bfloat16 or float16).

    Returns:
        A new dict: `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight` (absent
        when tied), and per layer `input_layernorm.weight`, `post_attention_layernorm.weight`,
        `self_attn.qkv_proj.weight` [(n_q + 2 n_kv) head_dim, hidden] (+ `.bias` with
        attention_bias), `self_attn.o_proj.weight`, `mlp.gate_up_proj.weight`
        [2 intermediate, hidden], `mlp.down_proj.weight`, and with qk_norm
        `self_attn.q_norm.weight` / `self_attn.k_norm.weight`; an MoE layer (config.moe_layers)
        has `mlp.gate.weight` [E, hidden], `mlp.experts.gate_up_proj` [E, 2 Ie, hidden] and
        `mlp.experts.down_proj` [E, hidden, Ie] instead of the MLP's matrices (kog.models.moe_weights:
        quantized expert stacks stay blocks). All contiguous. Matrices given as
        QuantizedWeight stay so (fused by byte rows, see kog.quantized.cat_rows), and so do
        Fp8Weight matrices (kog.fp8: rows with their scales).
    """

    if config.architecture == "laneformer_tp":  # its tensors under the Llama names, lane-major
        from kog.loader.laneformer import lane_weights_as_llama

        weights = lane_weights_as_llama(config, weights)

    def get(name: str) -> Tensor:
        if name not in weights:
            raise ModelLoadError(f"weight {name!r} is missing")
        w = weights[name]
        return w if isinstance(w, (QuantizedWeight, Fp8Weight)) else w.to(dtype)

    def cat(parts: list[Tensor]) -> Tensor:
        # NOTE: a fused matrix is quantized only when all its parts are (a float part among
        # quantized ones -- an F16 attn_v, say -- makes the whole group float: exact, more bytes).
        if all(isinstance(p, QuantizedWeight) for p in parts):
            return cat_rows(parts)
        if all(isinstance(p, Fp8Weight) for p in parts):
            return cat_fp8_rows(parts)
        return torch.cat([p.dequantize().to(dtype) if isinstance(p, (QuantizedWeight, Fp8Weight)) else p
                          for p in parts])

    out = {"model.embed_tokens.weight": _contiguous(get("model.embed_tokens.weight")),
           "model.norm.weight": get("model.norm.weight").contiguous()}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = _contiguous(get("lm_head.weight"))
    elif splits_replicated_head(config):  # a rank's slice of a tied head: the embedding's rows, copied
        n = config.vocab_size // config.shard.size
        rows = slice(config.shard.rank * n, (config.shard.rank + 1) * n)
        embed = out["model.embed_tokens.weight"]
        out["lm_head.weight"] = embed.take((rows,)) if isinstance(embed, QuantizedWeight) else embed[rows].clone()
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        a, m = p + "self_attn.", p + "mlp."
        out[a + "qkv_proj.weight"] = cat([get(a + f"{x}_proj.weight") for x in "qkv"])
        if config.attention_bias:
            out[a + "qkv_proj.bias"] = torch.cat([get(a + f"{x}_proj.bias") for x in "qkv"]).contiguous()
        if config.qk_norm:
            out[a + "q_norm.weight"] = get(a + "q_norm.weight").contiguous()
            out[a + "k_norm.weight"] = get(a + "k_norm.weight").contiguous()
        out[a + "o_proj.weight"] = _contiguous(get(a + "o_proj.weight"))
        if n in config.moe_layers:  # already stacked at load (kog.loader.moe); quantized stacks stay blocks
            moe = {x: get(m + x) for x in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")}
            shared = {x: get(m + x) for x in SHARED} if config.shared_expert_intermediate_size else {}
            for name, w in moe_layer(config, moe, shared, dtype).items():
                out[m + name] = w
        else:
            out[m + "gate_up_proj.weight"] = cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
            out[m + "down_proj.weight"] = _contiguous(get(m + "down_proj.weight"))
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = get(p + norm).contiguous()
        if config.lanes is not None and config.architecture != "laneformer_tp":
            # A model's lane form: o_proj and down_proj as lane-column matrices [L hidden, k / L]
            # (lane l: the columns of its heads / units), what a lane LINEAR into HIDDEN reads.
            for name in (a + "o_proj.weight", m + "down_proj.weight"):
                if name in out and config.lanes.num_lanes > 1:  # (one lane a rank: the matrix as it is)
                    out[name] = lane_columns(out[name], config.lanes.num_lanes)
            if n in config.moe_layers and config.shard.size > 1:  # expert parallelism
                ranks = expert_ranks(config)
                out[m + "experts.ranks"] = ranks
                # The rank keeps its experts' matrices only, in ascending expert order (what
                # MOE_EXPERTS reads with a placement: csrc/schedule/program.h Op::expert_ranks).
                # The routed ones are all it read (shard_index); of the shared expert's slices,
                # appended after them, it keeps its own.
                routed = len(rank_routed_experts(config))
                shared = (ranks[config.num_experts:] == config.shard.rank).nonzero().flatten()
                keep = torch.cat([torch.arange(routed), routed + shared])
                n_stack = routed + config.shared_expert_slots
                for name in ("experts.gate_up_proj", "experts.down_proj"):
                    stack = out[m + name]
                    if isinstance(stack, QuantizedWeight):  # [n_stack n, k] blocks: whole experts' byte rows
                        data = stack.data
                        if data.shape[0] % n_stack == 0:
                            out[m + name] = stack.with_data(
                                data.view(n_stack, -1, data.shape[1])[keep].reshape(-1, data.shape[1]).contiguous())
                            continue
                    elif isinstance(stack, torch.Tensor) and stack.shape[0] == n_stack:
                        out[m + name] = stack[keep].contiguous()
                        continue
                    raise ModelLoadError(f"{m + name}: a rank's expert stack must be its {routed} routed experts "
                                         f"(+ shared slices), got {type(stack).__name__} {tuple(stack.shape)}")
    return out


def pack_quantized(config: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The CPU's form of prepared weights: every quantized matrix row-interleaved
    (kog.quantized.pack_rows: same bytes, 2-4x faster decode GEMVs, PERFORMANCE.md issue 17), where
    its rows (an expert stack's rows per expert) come in whole groups of 8; the rest as given.
    A tensor under two names (a tied head) is packed once. KOG_PACK_QUANT=0 keeps the file forms
    (for comparisons)."""
    import os

    if os.environ.get("KOG_PACK_QUANT", "1") == "0":
        return weights
    done: dict[tuple, QuantizedWeight] = {}
    out = dict(weights)
    for name, w in weights.items():
        if not isinstance(w, QuantizedWeight):
            continue
        # an expert stack's rows per expert (however many experts a tensor-parallel rank holds)
        rows = (2 * config.moe_intermediate_size if name.endswith("experts.gate_up_proj")
                else config.hidden_size if name.endswith("experts.down_proj") else None)
        key = (w.data.data_ptr(), tuple(w.data.shape))  # the same bytes under two names, not a view of part
        if key not in done and can_pack(w, rows):
            done[key] = pack_rows(w)
        out[name] = done.get(key, w)
    return out


def expert_ranks(config: ModelConfig) -> torch.Tensor:
    """[experts + shared slots] int32: the rank each expert runs on, in contiguous blocks of
    routed experts (expert e on rank e N / E), the shared expert's slices round-robin."""
    E, S, N = config.num_experts, config.shared_expert_slots, config.shard.size
    return torch.tensor([e * N // E for e in range(E)] + [s % N for s in range(S)], dtype=torch.int32)


def rank_routed_experts(config: ModelConfig) -> range:
    """The routed experts config's rank runs (expert_ranks: one contiguous block), which is all a
    rank reads of the stored expert tensors (kog.parallel.shard.shard_index)."""
    E, N, r = config.num_experts, config.shard.size, config.shard.rank
    return range(-(-r * E // N), -(-(r + 1) * E // N))  # {e : e N // E == r}


def lane_columns(w: torch.Tensor, lanes: int) -> torch.Tensor:
    """[n, k] -> [lanes n, k / lanes]: block l is w[:, l k/lanes .. (l + 1) k/lanes]."""
    n, k = w.shape
    return w.view(n, lanes, k // lanes).transpose(0, 1).reshape(lanes * n, k // lanes).contiguous()


def weight_bytes(weights: dict[str, Tensor]) -> int:
    """Bytes the distinct tensors of a weight dict occupy (a tensor under two names counts once)."""
    seen: dict[int, int] = {}
    for w in weights.values():
        seen[w.data_ptr()] = max(seen.get(w.data_ptr(), 0), w.nbytes)
    return sum(seen.values())


def _contiguous(w: Tensor) -> Tensor:
    return w if isinstance(w, (QuantizedWeight, Fp8Weight)) else w.contiguous()
