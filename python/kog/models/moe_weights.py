"""An MoE layer's weights as the ROUTER and MOE_EXPERTS ops take them (kog.models.weights calls it).

    gate.weight            [E (+1), hidden] run dtype: the router (+ qwen2_moe's shared-expert gate row)
    experts.gate_up_proj   [E + S, 2 Ie, hidden] run dtype, or a QuantizedWeight of (E + S) 2 Ie block rows
    experts.down_proj      [E + S, hidden, Ie] run dtype, or a QuantizedWeight of (E + S) hidden block rows

S = config.shared_expert_slots. A quantized stack (a GGUF's `ffn_*_exps` kept in its blocks) is 2-D:
expert e's matrix is its rows [e n, (e + 1) n), so an expert is a byte offset, as in a float stack.
The two stacks are independent: either may be quantized (of any native type) or float. qwen2_moe's
shared expert joins a quantized stack in blocks when its matrices have the stack's type; otherwise
(an F16 shared down of a width that is not whole blocks, another block type) that stack runs
dequantized, in f32.
"""

from __future__ import annotations

from typing import Union

import torch

from kog.config import ModelConfig
from kog.quantized import QuantizedWeight

Tensor = Union[torch.Tensor, QuantizedWeight]

SHARED = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight",
          "shared_expert_gate.weight")


def moe_layer(config: ModelConfig, moe: dict[str, Tensor], shared: dict[str, Tensor], dtype: torch.dtype
              ) -> dict[str, Tensor]:
    """The layer's three tensors (module doc), contiguous.

    Args:
        config: an MoE model.
        moe: gate.weight, experts.gate_up_proj, experts.down_proj as loaded (kog.loader.moe's
            stacked float tensors, or QuantizedWeight stacks from a GGUF).
        shared: qwen2_moe's SHARED tensors ({} without a shared expert).
        dtype: the run dtype (f32 whenever a stack is quantized: the loader's rule).
    """
    ie = config.moe_intermediate_size
    router = _float(moe["gate.weight"], dtype)  # ROUTER takes run-dtype weights only
    gate_up, down = moe["experts.gate_up_proj"], moe["experts.down_proj"]
    if shared:
        router = torch.cat([router, _float(shared[SHARED[3]], dtype)])
        g, u, d = (shared[x] for x in SHARED[:3])  # [Is, h], [Is, h], [h, Is]
        if _same_type(gate_up, g, u):
            gate_up = _quantized_shared_gate_up(config, gate_up, g, u)
        else:
            gate_up = torch.cat([_float_stack(gate_up, 2 * ie, dtype),
                                 _shared_gate_up(config, _float(g, dtype), _float(u, dtype))])
        if _same_type(down, d):
            down = _quantized_shared_down(config, down, d)
        else:
            down = torch.cat([_float_stack(down, config.hidden_size, dtype), _shared_down(config, _float(d, dtype))])
    return {"gate.weight": router.contiguous(), "experts.gate_up_proj": _contiguous(gate_up, dtype),
            "experts.down_proj": _contiguous(down, dtype)}


# ---- internal helpers --------------------------------------------------------------------------
# NOTE (shared expert): exact: a SwiGLU MLP is the sum over any split of its intermediate units of
# the same MLP restricted to each part, and padded units (zero gate/up rows, zero down columns)
# contribute silu(0) * 0 = 0. The shared expert becomes `slots` expert-wide slices after the
# routed experts; in blocks, all-zero bytes are a zero block in every native type (every scale 0).


def _pad(config: ModelConfig) -> int:
    return config.shared_expert_slots * config.moe_intermediate_size - config.shared_expert_intermediate_size


def _shared_gate_up(config: ModelConfig, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    ie, slots, pad = config.moe_intermediate_size, config.shared_expert_slots, _pad(config)
    g, u = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (g, u))
    return torch.stack([torch.cat([g[c * ie:(c + 1) * ie], u[c * ie:(c + 1) * ie]]) for c in range(slots)])


def _shared_down(config: ModelConfig, d: torch.Tensor) -> torch.Tensor:
    ie, slots = config.moe_intermediate_size, config.shared_expert_slots
    d = torch.cat([d, d.new_zeros(d.shape[0], _pad(config))], dim=1)
    return torch.stack([d[:, c * ie:(c + 1) * ie] for c in range(slots)])


def _quantized_shared_gate_up(config: ModelConfig, stack: QuantizedWeight, g: QuantizedWeight,
                              u: QuantizedWeight) -> QuantizedWeight:
    # rows of blocks: the float slicing on byte rows (a row is whole blocks of `hidden` values)
    ie, slots, pad = config.moe_intermediate_size, config.shared_expert_slots, _pad(config)
    g, u = (torch.cat([t.data, t.data.new_zeros(pad, t.data.shape[1])]) for t in (g, u))
    parts = [torch.cat([g[c * ie:(c + 1) * ie], u[c * ie:(c + 1) * ie]]) for c in range(slots)]
    return stack.with_data(torch.cat([stack.data, *parts]).contiguous())


def _quantized_shared_down(config: ModelConfig, stack: QuantizedWeight, d: QuantizedWeight) -> QuantizedWeight:
    # columns of blocks: Ie and Is are whole blocks (both are rows of blocks in the file), so a
    # column slice of the matrix is a byte slice of each row.
    ie_bytes = stack.data.shape[1]  # one Ie-wide row of the stack
    pad_bytes = _pad(config) * ie_bytes // config.moe_intermediate_size  # whole blocks: exact
    data = torch.cat([d.data, d.data.new_zeros(d.data.shape[0], pad_bytes)], dim=1)
    parts = [data[:, c * ie_bytes:(c + 1) * ie_bytes] for c in range(config.shared_expert_slots)]
    return stack.with_data(torch.cat([stack.data, *parts]).contiguous())


def _same_type(stack: Tensor, *parts: Tensor) -> bool:
    return isinstance(stack, QuantizedWeight) and all(
        isinstance(p, QuantizedWeight) and p.qtype == stack.qtype for p in parts)


def _float_stack(w: Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A stack as float [E, rows, cols] (a quantized one dequantized)."""
    return w.dequantize().to(dtype).view(-1, rows, w.shape[1]) if isinstance(w, QuantizedWeight) else w.to(dtype)


def _float(w: Tensor, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize().to(dtype) if isinstance(w, QuantizedWeight) else w.to(dtype)


def _contiguous(w: Tensor, dtype: torch.dtype) -> Tensor:
    return w if isinstance(w, QuantizedWeight) else w.to(dtype).contiguous()
