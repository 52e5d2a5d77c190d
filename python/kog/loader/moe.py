"""Mixture-of-experts tensors as checkpoints store them, stacked into Kog's layout at load.

Kog's names for MoE layer N (kog.loader.weights.expected_shapes) are transformers 5.x's
in-memory ones, one tensor per kind for all E experts:

    model.layers.N.mlp.gate.weight           [E, hidden]          the router
    model.layers.N.mlp.experts.gate_up_proj  [E, 2 Ie, hidden]    each expert's [gate; up] rows
    model.layers.N.mlp.experts.down_proj     [E, hidden, Ie]

A checkpoint holds either those (fused), or one tensor per expert, as save_pretrained writes
them (transformers 4 and 5):

    qwen3_moe, qwen2_moe: mlp.gate.weight, mlp.experts.<e>.{gate,up,down}_proj.weight
    mixtral:   block_sparse_moe.gate.weight, block_sparse_moe.experts.<e>.{w1,w3,w2}.weight
               (w1 gate, w3 up, w2 down)

qwen2_moe's shared expert keeps its HF names (mlp.shared_expert.{gate,up,down}_proj.weight,
mlp.shared_expert_gate.weight [1, hidden]); kog.models.weights folds it into the stacks.
"""

from __future__ import annotations

import torch

from kog.config import ModelConfig

# family -> (module prefix, gate, up, down) of its per-expert tensors.
PER_EXPERT: dict[str, tuple[str, str, str, str]] = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def stored_experts(names: set[str], config: ModelConfig, layer: int) -> dict[str, list[str]]:
    """The stored tensors that make MoE layer `layer`'s three canonical tensors.

    Args:
        names: every tensor name of the checkpoint.
        config: the model (an MoE family).
        layer: a layer of config.moe_layers.
    Returns:
        {canonical name: stored names}: [itself] when the checkpoint holds it, else the
        per-expert tensors in stacking order (gate_up: gate_0, up_0, gate_1, up_1, ...).
    """
    p = f"model.layers.{layer}."
    block, gate, up, down = PER_EXPERT[config.architecture]
    router, gate_up, down_proj = p + "mlp.gate.weight", p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"
    experts = range(config.num_experts)
    return {
        router: [router] if router in names else [f"{p}{block}.gate.weight"],
        gate_up: [gate_up] if gate_up in names else
        [f"{p}{block}.experts.{e}.{x}.weight" for e in experts for x in (gate, up)],
        down_proj: [down_proj] if down_proj in names else [f"{p}{block}.experts.{e}.{down}.weight" for e in experts],
    }


def is_expert_stack(canonical: str) -> bool:
    """Whether `canonical` is one of the [E, ...] expert stacks (not the router)."""
    return canonical.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


def source_shape(canonical: str, stored: str, config: ModelConfig, expected: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape stored tensor `stored` must have to make `canonical` (one expert's matrix, or
    the canonical shape itself)."""
    if stored == canonical or canonical.endswith("mlp.gate.weight"):
        return expected[canonical]
    h, ie = config.hidden_size, config.moe_intermediate_size
    return (ie, h) if canonical.endswith("gate_up_proj") else (h, ie)


def combine(canonical: str, stored: list[str], tensors: list[torch.Tensor]) -> torch.Tensor:
    """The canonical tensor from its stored parts (stored_experts' order)."""
    if stored == [canonical] or canonical.endswith("mlp.gate.weight"):
        return tensors[0]
    if canonical.endswith("gate_up_proj"):  # [E, 2 Ie, hidden]: expert e's gate rows, then its up rows
        return torch.stack([torch.cat(tensors[i:i + 2]) for i in range(0, len(tensors), 2)])
    return torch.stack(tensors)  # down_proj: [E, hidden, Ie]
