"""The canonical weight set of a model: HF tensor names, shapes implied by the config, checks.

Every loader (safetensors, GGUF) produces the same flat dict
`{"model.layers.0.self_attn.q_proj.weight": tensor, ...}` in the run dtype, validated here.
When `tie_word_embeddings` is set the dict has no `lm_head.weight`: the runner reuses
`model.embed_tokens.weight`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

from kog.config import ModelConfig
from kog.errors import ModelLoadError

Weights = dict[str, torch.Tensor]

RUN_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
}

# Tensors some checkpoints carry that no model needs (old Llama exports store RoPE's inv_freq).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def run_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    """The dtype weights are loaded in: `dtype` if given, else bf16 for bf16 checkpoints, else f32.

    float16 checkpoints load as float32 by default: Kog's kernels compute in f32 or bf16, and
    f16 -> bf16 would drop mantissa bits.
    """
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if config.torch_dtype == "bfloat16" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in RUN_DTYPES.values():
            raise ModelLoadError(f"unsupported run dtype {dtype}")
        return dtype
    if dtype not in RUN_DTYPES:
        raise ModelLoadError(f"unsupported run dtype {dtype!r}; use one of {sorted(RUN_DTYPES)}")
    return RUN_DTYPES[dtype]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name, with its shape."""
    if config.architecture == "laneformer_tp":
        from kog.loader.laneformer import lane_expected_shapes

        return lane_expected_shapes(config)
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        }
        if n in config.moe_layers:  # stacked experts: transformers 5.x's in-memory layout
            e, ie = config.num_experts, config.moe_intermediate_size
            shapes |= {p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e, 2 * ie, h),
                       p + "mlp.experts.down_proj": (e, h, ie)}
            if config.shared_expert_intermediate_size:
                s, se = config.shared_expert_intermediate_size, p + "mlp.shared_expert."
                shapes |= {se + "gate_proj.weight": (s, h), se + "up_proj.weight": (s, h),
                           se + "down_proj.weight": (h, s), p + "mlp.shared_expert_gate.weight": (1, h)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)}
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def stored_sources(names: Iterable[str], config: ModelConfig) -> dict[str, list[str]]:
    """Which stored tensors make each canonical tensor of expected_shapes (kog.loader.moe):
    the tensor itself, or for an MoE layer stored one expert at a time, the per-expert tensors
    to stack (see kog.loader.moe.stored_experts)."""
    from kog.loader.moe import stored_experts

    names = set(names)
    sources = {n: [n] for n in expected_shapes(config)}
    for layer in config.moe_layers:
        sources |= stored_experts(names, config, layer)
    return sources


def select_names(names: Iterable[str], config: ModelConfig, source: str,
                 sources: dict[str, list[str]] | None = None) -> list[str]:
    """Checks a checkpoint's tensor names against the config; returns those to load, in order.

    Args:
        sources: the stored names that make each canonical name (stored_sources); None: each
            canonical name is stored as itself.
    Raises:
        ModelLoadError: a needed tensor is missing, or an unknown tensor is present (which
            usually means the config and the checkpoint disagree on the architecture).
    """
    names = set(names)
    expected = expected_shapes(config)
    needed = {n for srcs in sources.values() for n in srcs} if sources is not None else set(expected)
    missing = sorted(needed - names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{source}: missing tensor {missing[0]!r}{more}")
    extra = [n for n in sorted(names - needed) if not n.endswith(_IGNORED_SUFFIXES)]
    if config.tie_word_embeddings and "lm_head.weight" in extra:
        extra.remove("lm_head.weight")  # some tied checkpoints store the copy anyway
    if extra:
        raise ModelLoadError(f"{source}: unexpected tensor {extra[0]!r} for a {config.architecture} model")
    return list(expected)


def check_shape(name: str, shape: Iterable[int], expected: dict[str, tuple[int, ...]], source: str) -> None:
    """Raises ModelLoadError naming `source` and `name` if `shape` is not `expected[name]`."""
    want, got = expected[name], tuple(int(s) for s in shape)
    if got != want:
        raise ModelLoadError(f"{source}: tensor {name!r} has shape {list(got)}, expected {list(want)}")


def progress_bar(total: int, desc: str, progress: bool | None) -> Any:
    """A tqdm bar on stderr; off when `progress` is False, or None and stderr is not a TTY."""
    from tqdm.auto import tqdm

    enabled = sys.stderr.isatty() if progress is None else progress
    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, leave=False)
