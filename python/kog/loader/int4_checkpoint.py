"""HF checkpoints with 4-bit group-quantized linears (GPTQ, AWQ), as AutoGPTQ / GPTQModel /
AutoAWQ write them, turned into Kog's GGUF blocks (kept as stored, CPU) or dequantized.

A quantized linear `X` of [n, k] (out, in) is stored as int32-packed 4-bit codes q, per-group
zero points z and fp16 scales s, group g = `group_size` along k: w[r, c] = s[c // g, r] * (q[r, c]
- z[c // g, r]).
- `quant_method: "gptq"`: `X.qweight` int32 [k / 8, n] (8 codes along k per word, low nibble
  first), `X.qzeros` int32 [k / g, n / 8] (8 zeros along n per word), `X.scales` [k / g, n],
  `X.g_idx` int32 [k] (each column's group; with `desc_act` not c // g). `checkpoint_format`
  "gptq" (v1, the default) stores z - 1 in 4 bits, so its zeros are 1..16 (a stored 15 reads as
  16, as in GPTQ's own kernels); "gptq_v2" stores z.
- `quant_method: "awq"` (`version: "gemm"`): `X.qweight` int32 [k, n / 8], `X.qzeros` int32
  [k / g, n / 8], 8 values along n per word in AutoAWQ's order (nibble i holds column
  8 j + [0, 2, 4, 6, 1, 3, 5, 7][i]), `X.scales` [k / g, n].
Kept as stored (dtype None/"auto"), a matrix whose groups are whole 32-column blocks becomes
GGUF blocks with the same values: Q4_0 (d = s, q - 8) when every zero is 8, else Q4_1 (d = s,
m = -s z rounded to fp16, the one rounding: at most 2^-11 |s z| per value). Columns grouped out
of order (`desc_act` with a non-trivial g_idx) or groups that are not whole blocks are re-encoded
as Q8_0 (logged). With an explicit dtype every matrix is dequantized to it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kog.errors import ModelLoadError
from kog.quantized import QuantizedWeight, quantize_q8_0

log = logging.getLogger("kog")

SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")  # the stored tensors of one linear
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8 j + _AWQ_ORDER[i]


@dataclass(frozen=True)
class Int4Checkpoint:
    """The 4-bit form of a checkpoint, from config.json's quantization_config."""

    method: str  # "gptq" or "awq"
    group_size: int  # columns per group; -1 in the file: one group of all k columns
    zero_offset: int  # added to a stored zero (GPTQ v1 stores z - 1)

    def group_of(self, k: int) -> int:
        """Columns per group of a linear with k columns."""
        return k if self.group_size == -1 else self.group_size


def read_int4_checkpoint(folder: str | Path) -> Int4Checkpoint | None:
    """The folder's GPTQ / AWQ form; None without one (or for another quant_method).

    Raises:
        ModelLoadError: a GPTQ / AWQ config Kog cannot load, naming the field.
    """
    path = Path(folder) / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read config: {e}") from None
    if not isinstance(qc, dict) or qc.get("quant_method") not in ("gptq", "awq"):
        return None
    method = qc["quant_method"]
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"{path}: quantization_config bits={bits!r}: Kog loads 4-bit {method.upper()} only")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise ModelLoadError(f"{path}: quantization_config group_size={group!r} is not -1 or a positive size")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"{path}: quantization_config version={version!r}: Kog loads AWQ 'gemm' only")
        if qc.get("zero_point", True) is not True:
            raise ModelLoadError(f"{path}: quantization_config zero_point=false is not supported")
        return Int4Checkpoint("awq", group, 0)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{path}: quantization_config checkpoint_format={fmt!r} is not gptq or gptq_v2")
    return Int4Checkpoint("gptq", group, 1 if fmt == "gptq" else 0)


def _nibbles(words: torch.Tensor, along: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles (low first), laid out along dim `along` (0 or 1): uint8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    w = words.to(torch.int32)
    if along == 0:  # [a, b] -> [a * 8, b]
        return ((w[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, w.shape[1]).to(torch.uint8)
    return ((w[:, :, None] >> shifts[None, None, :]) & 15).reshape(w.shape[0], -1).to(torch.uint8)


def unpack(name: str, parts: dict[str, torch.Tensor], form: Int4Checkpoint, n: int, k: int):
    """(q uint8 [n, k], z int32 [n, groups], s f32 [n, groups], group of each column int64 [k])
    of the linear `name` (its ".weight" name) from its stored parts.

    Raises:
        ModelLoadError: a missing part or one whose shape does not fit [n, k], naming it.
    """
    base = name[: -len(".weight")]
    for suffix in (".qweight", ".qzeros", ".scales"):
        if base + suffix not in parts:
            raise ModelLoadError(f"{form.method.upper()} linear {base!r} has no {base + suffix!r}")
    group = form.group_of(k)
    groups = -(-k // group)
    qweight, qzeros, scales = parts[base + ".qweight"], parts[base + ".qzeros"], parts[base + ".scales"]
    if form.method == "gptq":
        want = {".qweight": (k // 8, n), ".qzeros": (groups, n // 8), ".scales": (groups, n)}
    else:
        want = {".qweight": (k, n // 8), ".qzeros": (groups, n // 8), ".scales": (groups, n)}
    for suffix, shape in want.items():
        got = tuple(parts[base + suffix].shape)
        if got != shape or k % 8 or n % 8:
            raise ModelLoadError(f"tensor {base + suffix!r} has shape {list(got)}, expected {list(shape)} for a "
                                 f"4-bit [{n}, {k}] linear with group_size {form.group_size}")
    if form.method == "gptq":
        q = _nibbles(qweight, along=0).T.contiguous()  # [n, k]
        z = _nibbles(qzeros, along=1).T.to(torch.int32) + form.zero_offset  # [n, groups]
    else:  # AWQ: columns in each word in _AWQ_ORDER
        order = torch.tensor([_AWQ_ORDER.index(i) for i in range(8)])  # column 8 j + m is nibble order[m]
        unorder = (torch.arange(n) // 8) * 8 + order[torch.arange(n) % 8]
        q = _nibbles(qweight, along=1)[:, unorder].T.contiguous()
        z = _nibbles(qzeros, along=1)[:, unorder].T.to(torch.int32)
    s = scales.float().T.contiguous()
    g_idx = parts.get(base + ".g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // group
    elif tuple(g_idx.shape) != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ModelLoadError(f"tensor {base + '.g_idx'!r} is not [{k}] group indices below {groups}")
    return q, z, s, g_idx.long()


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """f32 [n, k]: s[:, g] (q - z[:, g]) per column of group g."""
    return s[:, g_idx] * (q.float() - z[:, g_idx].float())


def int4_matrix(name: str, parts: dict[str, torch.Tensor], form: Int4Checkpoint, n: int, k: int,
                dtype: torch.dtype, keep: bool) -> torch.Tensor | QuantizedWeight:
    """The linear `name` [n, k]: GGUF blocks with the stored values (keep), else dequantized to dtype."""
    q, z, s, g_idx = unpack(name, parts, form, n, k)
    if not keep:
        return dequantize(q, z, s, g_idx).to(dtype)
    group = form.group_of(k)
    if k % 32 or group % 32 or not torch.equal(g_idx, torch.arange(k) // group):
        log.warning("%s: 4-bit groups that are not whole 32-column blocks in column order: re-encoded as Q8_0", name)
        return quantize_q8_0(dequantize(q, z, s, g_idx))
    zc, sc = z[:, g_idx[::32]], s[:, g_idx[::32]]  # per 32-column block: [n, k / 32]
    d = sc.half()
    lo, hi = q.view(n, k // 32, 32)[..., :16], q.view(n, k // 32, 32)[..., 16:]
    qs = (lo | (hi << 4)).to(torch.uint8)  # [n, k / 32, 16]: byte i = codes i and i + 16
    if bool((zc == 8).all()):  # Q4_0: d (q - 8)
        blocks = torch.cat([d.view(torch.uint8).view(n, k // 32, 2), qs], dim=2)
        return QuantizedWeight(blocks.reshape(n, -1).contiguous(), 2, k)
    m = (-(sc * zc.float())).half()  # Q4_1: d q + m
    blocks = torch.cat([d.view(torch.uint8).view(n, k // 32, 2), m.view(torch.uint8).view(n, k // 32, 2), qs], dim=2)
    return QuantizedWeight(blocks.reshape(n, -1).contiguous(), 3, k)
