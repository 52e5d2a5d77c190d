"""Plain-torch references for Kog's kernels: slow, obvious, and the ground truth of the op tests.

Each returns new tensors and never mutates its inputs. Math is fp32 with one rounding to the
input dtype per stored value, which is the contract the native kernels implement.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (out, new_residual): x [..., H], weight [H], residual [..., H] or None."""
    src = x
    new_residual = None
    if residual is not None:
        new_residual = (x.float() + residual.float()).to(x.dtype)
        src = new_residual
    s = src.float()
    inv_rms = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (s * inv_rms * weight.float()).to(x.dtype), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> [..., d] = silu(gate) * up."""
    d = x.shape[-1] // 2
    g, u = x[..., :d].float(), x[..., d:].float()
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


def rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    is_neox: bool = True,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, Hq, D], k [T, Hk, D] or None, positions [T], inv_freq [R/2] -> rotated (q, k)."""
    theta = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, R/2]
    cos = (torch.cos(theta) * attention_scaling)[:, None, :]
    sin = (torch.sin(theta) * attention_scaling)[:, None, :]

    def apply(x: torch.Tensor) -> torch.Tensor:
        rot = 2 * inv_freq.shape[0]
        xf = x.float()
        xr, rest = xf[..., :rot], xf[..., rot:]
        if is_neox:  # rotate_half: pairs (i, i + R/2)
            a, b = xr[..., : rot // 2], xr[..., rot // 2 :]
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:  # interleaved pairs (2i, 2i + 1), as complex numbers
            pairs = torch.view_as_complex(xr.reshape(*xr.shape[:-1], rot // 2, 2).contiguous())
            out = torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2)
        return torch.cat([out, rest], dim=-1).to(x.dtype)

    return apply(q), (apply(k) if k is not None else None)


def rope_inv_freq(rotary_dim: int, base: float, scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies with llama3/linear scaling, written as Meta's per-frequency loop."""
    freqs = [1.0 / (base ** (i / rotary_dim)) for i in range(0, rotary_dim, 2)]
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        freqs = [f / scaling["factor"] for f in freqs]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < old_len / high:
                out.append(f)
            elif wavelen > old_len / low:
                out.append(f / factor)
            else:
                smooth = (old_len / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        freqs = out
    return torch.tensor(freqs, dtype=torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] @ weight[n, k]^T (+ bias [n]) in fp64, rounded once to x's dtype."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
