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
from kog.quantized import QuantizedWeight, cat_rows

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
        `mlp.experts.down_proj` [E, hidden, Ie] instead of the MLP's matrices. All contiguous. Matrices given as
        QuantizedWeight stay so (fused by byte rows, see kog.quantized.cat_rows), and so do
        Fp8Weight matrices (kog.fp8: rows with their scales).
    """

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
        if n in config.moe_layers:  # already stacked at load (kog.loader.moe)
            moe = {name: _float(get(m + name), dtype) for name in ("gate.weight", "experts.gate_up_proj",
                                                                    "experts.down_proj")}
            if config.shared_expert_intermediate_size:
                moe = _with_shared_expert(config, moe, {x: _float(get(m + x), dtype) for x in _SHARED})
            for name, w in moe.items():
                out[m + name] = w.contiguous()
        else:
            out[m + "gate_up_proj.weight"] = cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
            out[m + "down_proj.weight"] = _contiguous(get(m + "down_proj.weight"))
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = get(p + norm).contiguous()
    return out


def weight_bytes(weights: dict[str, Tensor]) -> int:
    """Bytes the distinct tensors of a weight dict occupy (a tensor under two names counts once)."""
    seen: dict[int, int] = {}
    for w in weights.values():
        seen[w.data_ptr()] = max(seen.get(w.data_ptr(), 0), w.nbytes)
    return sum(seen.values())


_SHARED = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight",
           "shared_expert_gate.weight")


def _with_shared_expert(config: ModelConfig, moe: dict[str, torch.Tensor],
                        shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """qwen2_moe's shared expert as config.shared_expert_slots more experts after the routed
    ones, and its sigmoid gate as one more router row (the ROUTER op's layout: program.h).

    NOTE: exact: a SwiGLU MLP is the sum over any split of its intermediate units of the same
    MLP restricted to each part, and padded units (zero gate/up rows, zero down columns)
    contribute silu(0) * 0 = 0.
    """
    ie, slots = config.moe_intermediate_size, config.shared_expert_slots
    pad = slots * ie - config.shared_expert_intermediate_size
    g, u, d = (shared[x] for x in _SHARED[:3])  # [Is, h], [Is, h], [h, Is]
    g, u = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (g, u))
    d = torch.cat([d, d.new_zeros(d.shape[0], pad)], dim=1)
    gate_up = torch.stack([torch.cat([g[c * ie:(c + 1) * ie], u[c * ie:(c + 1) * ie]]) for c in range(slots)])
    down = torch.stack([d[:, c * ie:(c + 1) * ie] for c in range(slots)])
    return {"gate.weight": torch.cat([moe["gate.weight"], shared["shared_expert_gate.weight"]]),
            "experts.gate_up_proj": torch.cat([moe["experts.gate_up_proj"], gate_up]),
            "experts.down_proj": torch.cat([moe["experts.down_proj"], down])}


def _float(w: Tensor, dtype: torch.dtype) -> torch.Tensor:
    # The MoE ops take run-dtype weights only (validate_program): quantized experts dequantize.
    return w.dequantize().to(dtype) if isinstance(w, (QuantizedWeight, Fp8Weight)) else w


def _contiguous(w: Tensor) -> Tensor:
    return w if isinstance(w, (QuantizedWeight, Fp8Weight)) else w.contiguous()
