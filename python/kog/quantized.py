"""Matrices kept in a GGUF file's block layout (issue 17): never dequantized as a whole.

A `QuantizedWeight` is the bytes of an [rows, cols] matrix as llama.cpp stores it -- each row
cols / block_elems blocks laid end to end -- plus its ggml type. Rows are independent, so
row operations (concatenating q/k/v, llama's q/k row un-permutation, taking one embedding row)
act on whole byte rows. The decode executor dots them as stored (kog._C linear_quant kernels);
the prefill interpreter dequantizes tiles of rows at a time (`dequantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kog.errors import InvalidRequest


@dataclass(frozen=True)
class QuantizedWeight:
    """data: uint8 [rows, row_bytes], contiguous; qtype: ggml type id (kog.ops.QUANT_TYPES); cols: k."""

    data: torch.Tensor
    qtype: int
    cols: int

    def __post_init__(self) -> None:
        from kog.ops import quant_type_name, quant_row_bytes

        row_bytes = quant_row_bytes(self.qtype, self.cols)  # InvalidRequest for a type without kernels
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != row_bytes:
            raise InvalidRequest(f"{quant_type_name(self.qtype)} weight of {self.cols} columns must be uint8 "
                                 f"[rows, {row_bytes}], got {self.data.dtype} {tuple(self.data.shape)}")

    # Tensor-like views the runner's bookkeeping uses (sizes, addresses, device).
    @property
    def shape(self) -> tuple[int, int]:
        """The logical [rows, cols] shape of the matrix."""
        return (int(self.data.shape[0]), self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def type_name(self) -> str:
        from kog.ops import quant_type_name

        return quant_type_name(self.qtype)

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def with_data(self, data: torch.Tensor) -> QuantizedWeight:
        """The same matrix over other bytes (a copy elsewhere, rows reordered)."""
        return QuantizedWeight(data, self.qtype, self.cols)

    def dequantize(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """f32 [n, cols] of the given rows (a slice, int64 ids, or None: all), as gguf.quants computes."""
        from kog.ops import dequantize_rows

        if isinstance(rows, slice):
            return dequantize_rows(self.data[rows], self.qtype)
        return dequantize_rows(self.data, self.qtype, rows)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """[a; b; ...] of matrices with the same columns.

    NOTE: parts of one type keep their blocks (rows are independent). Parts of different types
    (llama.cpp's mixes, e.g. attn_v in Q6_K beside Q4_K q/k) are re-encoded together as Q8_0:
    one fused GEMV needs one type, and Q8_0 is the finest format Kog has kernels for, so it adds
    at most amax(block) * (1/254 + 1/2048) per element (half a step, d in fp16) to the file's (coarser) rounding; those groups take
    more bytes than in the file (kog.models.weights reports the resident total).
    """
    cols = parts[0].cols
    if any(p.cols != cols for p in parts):
        raise InvalidRequest(f"cat_rows: parts have {[p.cols for p in parts]} columns")
    if all(p.qtype == parts[0].qtype for p in parts):
        return parts[0].with_data(torch.cat([p.data for p in parts]).contiguous())
    return quantize_q8_0(torch.cat([p.dequantize() for p in parts]))


def quantize_q8_0(w: torch.Tensor) -> QuantizedWeight:
    """An f32 [rows, cols] matrix (cols a multiple of 32) as Q8_0 blocks (llama.cpp's encoder)."""
    import gguf

    from kog.ops import QUANT_TYPES

    q = gguf.quants.quantize(np.ascontiguousarray(w.float().numpy()), gguf.GGMLQuantizationType.Q8_0)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(q)), QUANT_TYPES["Q8_0"][0], int(w.shape[1]))
