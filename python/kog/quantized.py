"""Matrices kept in a GGUF file's block layout (issue 17): never dequantized as a whole.

A `QuantizedWeight` is the bytes of an [rows, cols] matrix as llama.cpp stores it -- each row
cols / block_elems blocks laid end to end -- plus its ggml type. Rows are independent, so
row operations (concatenating q/k/v, llama's q/k row un-permutation, taking one embedding row)
act on whole byte rows. The decode executor dots them as stored (kog._C linear_quant kernels);
the prefill interpreter dequantizes tiles of rows at a time (`dequantize`).

On the CPU the runner packs Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K matrices once at load into Kog's row-interleaved
forms (`pack_rows`: Q4_1 -> Q4_1_R8, same bytes, csrc/ops/quant.h), which the decode GEMV reads
8 rows per instruction; every kernel that takes the file form takes the packed one too. A packed
matrix's byte rows are no longer its rows: `dequantize` gathers them, and row surgery
(`cat_rows`, reordering) is for file forms only.
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

    @property
    def file_type_name(self) -> str:
        """The GGUF type of the blocks: type_name without the packed form's `_R8`."""
        return self.type_name.removesuffix("_R8")

    @property
    def packed(self) -> bool:
        """True for a row-interleaved form (pack_rows), whose byte rows interleave 8 rows."""
        from kog.ops import PACKED_QUANT_TYPES

        return any(v[0] == self.qtype for v in PACKED_QUANT_TYPES.values())

    def dequantize(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """f32 [n, cols] of the given rows (a slice, int64 ids, or None: all), as gguf.quants computes."""
        from kog.ops import dequantize_rows

        if isinstance(rows, slice):
            if self.packed:
                return dequantize_rows(self.data, self.qtype, torch.arange(self.shape[0])[rows])
            return dequantize_rows(self.data[rows], self.qtype)
        return dequantize_rows(self.data, self.qtype, rows)


# Header fields (fp16 each) and quant bytes of one block of the types pack_rows interleaves.
# Q5: 4 qh + 16 qs bytes; Q4_K: 12 scale + 128 quant bytes.
_PACK_LAYOUT = {"Q4_0": (1, 16), "Q4_1": (2, 16), "Q5_0": (1, 20), "Q5_1": (2, 20), "Q8_0": (1, 32), "Q4_K": (2, 140)}


def _packed_id(base: int) -> int | None:
    from kog.ops import PACKED_QUANT_TYPES

    return next((v[0] for v in PACKED_QUANT_TYPES.values() if v[1] == base), None)


def can_pack(w: QuantizedWeight, rows: int | None = None) -> bool:
    """Whether pack_rows applies: a file type with a packed form (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K), and whole groups of 8 rows
    (of every sub-matrix of `rows` rows, e.g. one expert of a stack, when given)."""
    n = w.shape[0] if rows is None else rows
    return not w.packed and _packed_id(w.qtype) is not None and n > 0 and w.shape[0] % n == 0 and n % 8 == 0


def pack_rows(w: QuantizedWeight) -> QuantizedWeight:
    """The same matrix in its row-interleaved form (csrc/ops/quant.h, BlockQ4_1x8): group g = rows
    8g..8g+7, unit u = their blocks u with each header field as 8 halves, then the quants in
    32-byte chunks of 4 bytes per row. Same bytes; InvalidRequest where can_pack is false."""
    if not can_pack(w):
        raise InvalidRequest(f"pack_rows: a {w.type_name} matrix of {w.shape[0]} rows has no packed form "
                             f"(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K in whole groups of 8 rows)")
    hdr, qs = _PACK_LAYOUT[w.type_name]
    n, row_bytes = w.data.shape
    block = 2 * hdr + qs
    b = w.data.view(n // 8, 8, row_bytes // block, block).transpose(1, 2)  # [G, nb, 8 rows, block]
    heads = b[..., :2 * hdr].reshape(*b.shape[:3], hdr, 2).transpose(2, 3)  # [G, nb, hdr, 8, 2]
    quants = b[..., 2 * hdr:].reshape(*b.shape[:3], qs // 4, 4).transpose(2, 3)  # [G, nb, chunk, 8, 4]
    unit = torch.cat([heads.reshape(*b.shape[:2], -1), quants.reshape(*b.shape[:2], -1)], dim=2)
    return QuantizedWeight(unit.reshape(n, row_bytes).contiguous(), _packed_id(w.qtype), w.cols)


def unpack_rows(w: QuantizedWeight) -> QuantizedWeight:
    """pack_rows inverted: the file form of a packed matrix."""
    from kog.ops import quant_file_type

    if not w.packed:
        return w
    hdr, qs = _PACK_LAYOUT[w.file_type_name]
    n, row_bytes = w.data.shape
    block = 2 * hdr + qs
    u = w.data.view(n // 8, row_bytes // block, 8 * block)  # [G, nb, unit]
    heads = u[..., :16 * hdr].reshape(*u.shape[:2], hdr, 8, 2).transpose(2, 3)  # [G, nb, 8, hdr, 2]
    quants = u[..., 16 * hdr:].reshape(*u.shape[:2], qs // 4, 8, 4).transpose(2, 3)  # [G, nb, 8, chunk, 4]
    blocks = torch.cat([heads.reshape(*u.shape[:2], 8, -1), quants.reshape(*u.shape[:2], 8, -1)], dim=3)
    return QuantizedWeight(blocks.transpose(1, 2).reshape(n, row_bytes).contiguous(), quant_file_type(w.qtype), w.cols)


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
    if any(p.packed for p in parts):
        raise InvalidRequest("cat_rows: packed (row-interleaved) matrices are not rows; fuse before pack_rows")
    if all(p.qtype == parts[0].qtype for p in parts):
        return parts[0].with_data(torch.cat([p.data for p in parts]).contiguous())
    return quantize_q8_0(torch.cat([p.dequantize() for p in parts]))


def quantize_q8_0(w: torch.Tensor) -> QuantizedWeight:
    """An f32 [rows, cols] matrix (cols a multiple of 32) as Q8_0 blocks (llama.cpp's encoder)."""
    import gguf

    from kog.ops import QUANT_TYPES

    q = gguf.quants.quantize(np.ascontiguousarray(w.float().numpy()), gguf.GGMLQuantizationType.Q8_0)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(q)), QUANT_TYPES["Q8_0"][0], int(w.shape[1]))
