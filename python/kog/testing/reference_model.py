"""A plain-torch forward of a whole Llama-family model: no KV cache, no paging, no fused weights.

    logits = reference_logits(loaded.config, loaded.weights, token_ids)   # [T, vocab] f32

Built from the kernel references (kog.testing.reference) on the checkpoint's HF-named weights,
in fp32; the ground truth for what the engine reports per position (prompt logprobs).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from kog.config import ModelConfig
from kog.testing import reference as ref


def reference_logits(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                     token_ids: Sequence[int]) -> torch.Tensor:
    """[len(token_ids), vocab] f32 next-token logits after every position of one sequence."""
    c = config
    w = {k: v.float() for k, v in weights.items()}
    T, hd = len(token_ids), c.head_dim
    positions = torch.arange(T)
    inv_freq = ref.rope_inv_freq(hd, c.rope_theta, c.rope_scaling)
    x = w["model.embed_tokens.weight"][torch.tensor(list(token_ids))]  # [T, hidden]
    for n in range(c.num_hidden_layers):
        p = f"model.layers.{n}."
        h, _ = ref.rmsnorm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = ref.linear(h, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias")).view(T, -1, hd)
        k = ref.linear(h, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias")).view(T, -1, hd)
        v = ref.linear(h, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias")).view(T, -1, hd)
        if c.qk_norm:
            q, _ = ref.rmsnorm(q, w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
            k, _ = ref.rmsnorm(k, w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
        q, k = ref.rope(q, k, positions, inv_freq)
        x = x + ref.linear(_causal_attention(q, k, v).reshape(T, -1), w[p + "self_attn.o_proj.weight"])
        h, _ = ref.rmsnorm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = ref.linear(h, w[p + "mlp.gate_proj.weight"])
        up = ref.linear(h, w[p + "mlp.up_proj.weight"])
        gate_up = torch.cat([gate, up], dim=-1)  # [T, 2 * intermediate]
        x = x + ref.linear(ref.silu_and_mul(gate_up), w[p + "mlp.down_proj.weight"])
    h, _ = ref.rmsnorm(x, w["model.norm.weight"], c.rms_norm_eps)
    lm_head = w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    return ref.linear(h, lm_head)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hk, D] -> [T, Hq, D]; query heads grouped over KV heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5  # [Hq, T, T]
    T = q.shape[0]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
