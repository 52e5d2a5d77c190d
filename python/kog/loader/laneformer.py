"""Laneformer checkpoints (HF `LaneformerTPForCausalLM`): tensor names and shapes, and the
renaming into the Llama names kog.models.weights fuses.

Stored layout, with L lanes, H query heads, KV heads, head_dim d = hidden / H, ffn = intermediate:

    model.tok_embeddings.weight                     [vocab, hidden]
    model.layers.N.attention.wq.weight              [L, H d / L, hidden]     lane l: heads l H/L ..
    model.layers.N.attention.wk.weight / wv         [L, KV d / L, hidden]
    model.layers.N.attention.wo.weight              [L, hidden, H d / L]     lane l's heads -> a_l
    model.layers.N.feed_forward.w1.weight / w3      [L, ffn / L, hidden]
    model.layers.N.feed_forward.w2.weight           [L, hidden, ffn / L]
    model.layers.N.attention_norm.weight / ffn_norm [hidden] (replicated_rmsn_scale), else .scale [L, hidden]
    model.norm.weight [hidden] (replicated or pre_norm_lane_agg), else model.norm.scale [L, hidden]
    lm_head.weight [vocab, hidden] (replicate; absent when tied) | lm_head.linear.weight
    [vocab, L hidden] (lane) | lm_head.weight [L, vocab / L, hidden] (vocab_parallel)

Each [L, rows, k] lane matrix flattens to [L rows, k] with rows lane-major: exactly the weight
of a lane LINEAR (kog.program.lanes), so renaming is a reshape, no copy.
"""

from __future__ import annotations

import torch

from kog.config import ModelConfig


def lane_expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Laneformer checkpoint, by HF name, with its shape."""
    lanes = config.lanes
    assert lanes is not None
    L, h, ffn, V = lanes.num_lanes, config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    norm = (lambda p: {p + ".weight": (h,)}) if lanes.replicated_rmsn_scale else (lambda p: {p + ".scale": (L, h)})
    shapes: dict[str, tuple[int, ...]] = {"model.tok_embeddings.weight": (V, h)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes |= {p + "attention.wq.weight": (L, q // L, h), p + "attention.wk.weight": (L, kv // L, h),
                   p + "attention.wv.weight": (L, kv // L, h), p + "attention.wo.weight": (L, h, q // L),
                   p + "feed_forward.w1.weight": (L, ffn // L, h), p + "feed_forward.w3.weight": (L, ffn // L, h),
                   p + "feed_forward.w2.weight": (L, h, ffn // L)}
        shapes |= norm(p + "attention_norm") | norm(p + "ffn_norm")
    shapes |= {"model.norm.weight": (h,)} if lanes.pre_norm_lane_agg else norm("model.norm")
    if lanes.lm_head_type == "lane":
        shapes["lm_head.linear.weight"] = (V, L * h)
    elif lanes.lm_head_type == "vocab_parallel":  # a rank's shard: its lanes' rows of V / (all lanes)
        shapes["lm_head.weight"] = (L, V // (L * config.shard.size), h)
    elif not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, h)
    return shapes


def lane_weights_as_llama(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the Llama names prepare_weights fuses (views where possible):
    lane matrices flattened lane-major, per-lane norm scales flattened to [L hidden]."""
    def get(name: str) -> torch.Tensor:
        from kog.errors import ModelLoadError

        if name not in weights:
            raise ModelLoadError(f"weight {name!r} is missing")
        return weights[name]

    def flat(t: torch.Tensor) -> torch.Tensor:  # [L, rows, k] -> [L rows, k]
        return t.reshape(-1, t.shape[-1]) if t.dim() == 3 else t

    def norm(prefix: str) -> torch.Tensor:  # [hidden], or [L, hidden] -> [L hidden]
        return get(prefix + ".weight" if prefix + ".weight" in weights else prefix + ".scale").reshape(-1)

    out = {"model.embed_tokens.weight": get("model.tok_embeddings.weight"), "model.norm.weight": norm("model.norm")}
    head = next((n for n in ("lm_head.linear.weight", "lm_head.weight") if n in weights), None)
    if head is not None and not config.tie_word_embeddings:
        out["lm_head.weight"] = flat(weights[head])
    for n in range(config.num_hidden_layers):
        src, dst = f"model.layers.{n}.", f"model.layers.{n}."
        for x in "qkv":
            out[dst + f"self_attn.{x}_proj.weight"] = flat(get(src + f"attention.w{x}.weight"))
        out[dst + "self_attn.o_proj.weight"] = flat(get(src + "attention.wo.weight"))
        out[dst + "mlp.gate_proj.weight"] = flat(get(src + "feed_forward.w1.weight"))
        out[dst + "mlp.up_proj.weight"] = flat(get(src + "feed_forward.w3.weight"))
        out[dst + "mlp.down_proj.weight"] = flat(get(src + "feed_forward.w2.weight"))
        out[dst + "input_layernorm.weight"] = norm(src + "attention_norm")
        out[dst + "post_attention_layernorm.weight"] = norm(src + "ffn_norm")
    return out
