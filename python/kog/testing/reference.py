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
def linear_fp8(x: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor, fmt: str,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 GEMV (kog._C.WEIGHT_FP8): x [..., k] @ e4m3(bits [n, k] uint8, encoding fmt)^T,
    times scale [n] f32 once per output (+ bias [n]), in fp64, rounded once to x's dtype."""
    from kog.fp8 import decode

    out = (x.double() @ decode(bits, fmt).double().T) * scale.double()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def linear_q4(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The 4-bit GEMV (kog.int4.Int4Weight, WEIGHT_Q4_GROUPS / WEIGHT_Q4_K): x [..., k] @
    weight.dequantize()^T (+ bias [n]), in fp64, rounded once to x's dtype."""
    out = x.double() @ weight.dequantize().double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cache as dense (k, v), each [seq_len, n_kv_heads, head_dim].

    kv_cache: one layer [num_blocks, 2, n_kv_heads, block_size, head_dim]; block_table: [>= blocks used].
    """
    block_size = kv_cache.shape[3]
    n_blocks = -(-seq_len // block_size)
    blocks = kv_cache[block_table[:n_blocks].long()]  # [n_blocks, 2, Hk, block_size, D]
    dense = blocks.permute(1, 0, 3, 2, 4).reshape(2, n_blocks * block_size, *blocks.shape[2:3], blocks.shape[4])
    return dense[0, :seq_len], dense[1, :seq_len]


def kv_append(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """A new cache with token i's k, v [T, Hk, D] at slot_mapping[i] (skipped when < 0)."""
    out = kv_cache.clone()
    block_size = kv_cache.shape[3]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            out[slot // block_size, 0, :, slot % block_size] = k[i]
            out[slot // block_size, 1, :, slot % block_size] = v[i]
    return out


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    scale: float | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its gathered cache, in fp32.

    q: [T, Hq, D]; query_start_loc [S + 1] (None = one query per sequence, decode); a query
    row i of a chunk of q_len rows sits at position seq_len - q_len + i. window > 0: a row at
    position t sees only positions j with t - window < j (a sliding window).
    """
    n_seqs = block_tables.shape[0]
    if query_start_loc is None:
        query_start_loc = torch.arange(n_seqs + 1)
    head_dim = q.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    group = q.shape[1] // kv_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for s in range(n_seqs):
        a, b = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len, q_len = int(seq_lens[s]), b - a
        if q_len == 0:
            continue
        k, v = gather_kv(kv_cache, block_tables[s], seq_len)
        k = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale  # [Hq, q_len, L]
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        keys = torch.arange(seq_len)[None, :]
        hidden = (keys > pos) | ((keys <= pos - window) if window > 0 else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized per 32-element block as kog's quantized linear does it (Q8-style).

    Args:
        x: [m, k] float, k a multiple of 32.

    Returns:
        q: [m, k] float32 holding the int8 values round_half_even(x / d), d = amax / 127 (fp32 math).
        d: [m, k // 32] float32 block scales.
    """
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(dim=-1) / torch.tensor(127.0)
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])  # torch.round: half to even, as the kernels
    return q.reshape(x.shape), d


def linear_quant_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Bound on |x @ W.T - xq @ W.T| from quantizing x per 32-element block: |x - xq| <= amax / 254.

    Args:
        x: [m, k] float; weight: [n, k] the dequantized weights.

    Returns:
        [m, n] float64.
    """
    xb = x.double().reshape(x.shape[0], -1, 32)
    half_step = (xb.abs().amax(dim=-1, keepdim=True) / 254.0).expand_as(xb).reshape(x.shape)
    return half_step @ weight.double().abs().T
