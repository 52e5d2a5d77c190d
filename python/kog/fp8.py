"""FP8 e4m3 weights with one f32 scale per output channel (issue 17): the GPU decode kernel's
`kog._C.WEIGHT_FP8` format (csrc/schedule/program.h).

Two encodings share the bit layout s eeee mmm: OCP e4m3fn (exponent bias 7, max 448, NaN at
0x7f/0xff; what NVIDIA's kernels read) and e4m3fnuz (bias 8, max 240, NaN at 0x80, no negative
zero; AMD MI300X's). The same bits are values a factor 2 apart (fn = 2 * fnuz), so an FP8 matrix
is encoded for its target (`gpu_format`) and moves between the two exactly with `to_format`.
torch's float8_e4m3fn / float8_e4m3fnuz dtypes do the rounding (nearest even).

    w8 = quantize(w, "e4m3fn")      # Fp8Weight: data uint8 [n, k], scale f32 [n]
    w8.dequantize()                 # f32 [n, k] = scale[:, None] * e4m3(data)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kog.errors import InvalidRequest

FORMATS = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
FORMAT_MAX = {"e4m3fn": 448.0, "e4m3fnuz": 240.0}


def gpu_format() -> str:
    """The e4m3 encoding this build's GPU kernel reads: "e4m3fnuz" on ROCm, else "e4m3fn"
    (also for a CPU build: FP8 weights are then dequantized at load, any encoding will do)."""
    from kog import _C

    return "e4m3fnuz" if _C.build_info().get("backend") == "rocm" else "e4m3fn"


def _dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise InvalidRequest(f"unknown FP8 format {fmt!r} (supported: {sorted(FORMATS)})")
    return FORMATS[fmt]


def encode(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 bits of `values` rounded to e4m3 `fmt` (nearest even; values past the format's max
    must have been scaled away: torch saturates neither encoding the same way)."""
    return values.float().to(_dtype(fmt)).view(torch.uint8)


def decode(bits: torch.Tensor, fmt: str) -> torch.Tensor:
    """f32 values of uint8 e4m3 `bits` in `fmt` (NaN codes decode to NaN)."""
    return bits.view(_dtype(fmt)).float()


@dataclass(frozen=True)
class Fp8Weight:
    """data: uint8 [rows, cols] e4m3 bits in `fmt`, contiguous; scale: f32 [rows]; the matrix is
    scale[:, None] * decode(data, fmt)."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str

    def __post_init__(self) -> None:
        _dtype(self.fmt)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise InvalidRequest(f"FP8 weight bits must be uint8 [rows, cols], got {self.data.dtype} "
                                 f"{tuple(self.data.shape)}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.data.shape[0],):
            raise InvalidRequest(f"FP8 weight scale must be f32 [{self.data.shape[0]}], got {self.scale.dtype} "
                                 f"{tuple(self.scale.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), int(self.data.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scale.to(device), self.fmt)

    def dequantize(self) -> torch.Tensor:
        """f32 [rows, cols]."""
        return decode(self.data, self.fmt) * self.scale[:, None]

    def dequantize_rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """f32 [stop - start, cols] of rows [start, stop), on the weight's device."""
        return decode(self.data[start:stop], self.fmt) * self.scale[start:stop, None]


def quantize(w: torch.Tensor, fmt: str) -> Fp8Weight:
    """w [rows, cols] as FP8 with one scale per row: scale = absmax(row) / max(fmt) (1 for a zero
    row), bits = e4m3(w / scale) rounded to nearest even.

    Raises:
        InvalidRequest: w is not a finite 2-D matrix.
    """
    _dtype(fmt)
    if w.dim() != 2:
        raise InvalidRequest(f"quantize: FP8 weights are matrices, got shape {tuple(w.shape)}")
    wf = w.float()
    if not torch.isfinite(wf).all():
        raise InvalidRequest("quantize: the weight has non-finite values")
    absmax = wf.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / FORMAT_MAX[fmt], torch.ones_like(absmax))
    q = (wf / scale[:, None]).clamp(-FORMAT_MAX[fmt], FORMAT_MAX[fmt])
    return Fp8Weight(encode(q, fmt).contiguous(), scale.contiguous(), fmt)


def to_format(w: Fp8Weight, fmt: str) -> Fp8Weight:
    """The same matrix in encoding `fmt`, exactly: the bits stay (fn's -0, 0x80, becomes fnuz's
    +0) and the scale doubles (fn -> fnuz) or halves (fnuz -> fn). fnuz's 0x7f (240) has no fn
    twin (its bits are fn's NaN): such a matrix is re-quantized in fn instead (one rounding).

    Raises:
        InvalidRequest: the bits hold a NaN code of their encoding.
    """
    _dtype(fmt)
    if not torch.isfinite(decode(w.data, w.fmt)).all():
        raise InvalidRequest(f"FP8 weight holds NaN codes of {w.fmt}")
    if fmt == w.fmt:
        return w
    if fmt == "e4m3fnuz":  # fn -> fnuz: the same bits are half the value
        data = torch.where(w.data == 0x80, torch.zeros_like(w.data), w.data)
        return Fp8Weight(data, w.scale * 2, fmt)
    if bool(((w.data & 0x7F) == 0x7F).any()):  # fnuz 240: fn's NaN code
        return quantize(w.dequantize(), fmt)
    return Fp8Weight(w.data, w.scale / 2, fmt)


def cat_rows(parts: list[Fp8Weight]) -> Fp8Weight:
    """[a; b; ...] of FP8 matrices with the same columns and encoding (rows keep their scales:
    exact, as the fused q/k/v and gate/up GEMVs need)."""
    if any(p.fmt != parts[0].fmt or p.shape[1] != parts[0].shape[1] for p in parts):
        raise InvalidRequest(f"cat_rows: FP8 parts differ in encoding or columns: "
                             f"{[(p.fmt, p.shape) for p in parts]}")
    return Fp8Weight(torch.cat([p.data for p in parts]).contiguous(), torch.cat([p.scale for p in parts]).contiguous(),
                     parts[0].fmt)
