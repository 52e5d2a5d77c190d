"""Matrices kept in a GGUF file's block layout (issue 17): never dequantized as a whole.

A `QuantizedWeight` is the bytes of an [rows, cols] matrix as llama.cpp stores it -- each row
cols / block_elems blocks laid end to end -- plus its ggml type. Rows are independent, so
row operations (concatenating q/k/v, llama's q/k row un-permutation, taking one embedding row)
act on whole byte rows. The decode executor dots them as stored (kog._C linear_quant kernels);
the prefill interpreter dequantizes tiles of rows at a time (`dequantize`).

On the CPU the runner packs Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrices once at load into Kog's row-interleaved
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


def block_columns(qtype: int, lo: int, hi: int) -> tuple[int, int]:
    """(first byte, byte count) of columns [lo, hi) in a byte row of qtype's blocks.

    Raises:
        InvalidRequest: lo or hi inside a block, or a type without kernels.
    """
    from kog.ops import quant_row_bytes

    return (quant_row_bytes(qtype, lo) if lo else 0), quant_row_bytes(qtype, hi - lo)


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

    def take(self, index: tuple[slice, ...]) -> QuantizedWeight:
        """Part of a file-form matrix as a torch index on [rows, cols] takes it: (rows,) or
        (rows, cols) with cols in whole blocks (a tensor-parallel rank's share), copied.

        Raises:
            InvalidRequest: a packed matrix, a step, or columns that cut a block.
        """
        if self.packed or len(index) > 2 or any(s.step not in (None, 1) for s in index):
            raise InvalidRequest(f"cannot take {index} of a {self.type_name} matrix")
        data = self.data[index[0]]
        if len(index) == 1 or index[1] == slice(None):
            return self.with_data(data.clone())  # its own bytes (a view would share the whole's address)
        lo, hi, _ = index[1].indices(self.cols)
        start, n = block_columns(self.qtype, lo, hi)
        return QuantizedWeight(data[:, start:start + n].contiguous(), self.qtype, hi - lo)

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


def _layout(packed_id: int) -> tuple[int, int, int, int]:
    """(fp16 fields leading a block, bytes of its 4-byte chunks, fp16 fields ending it, block bytes)
    of the file type a packed type interleaves: csrc/ops/quant.h's PackLayout, from kog._C."""
    from kog.ops import PACKED_QUANT_TYPES, QUANT_TYPES, quant_file_type

    _, _, _, front, back = next(v for v in PACKED_QUANT_TYPES.values() if v[0] == packed_id)
    base = quant_file_type(packed_id)
    block = next(v[2] for v in QUANT_TYPES.values() if v[0] == base)
    return front, block - 2 * (front + back), back, block


def _packed_id(base: int) -> int | None:
    from kog.ops import PACKED_QUANT_TYPES

    return next((v[0] for v in PACKED_QUANT_TYPES.values() if v[1] == base), None)


def can_pack(w: QuantizedWeight, rows: int | None = None) -> bool:
    """Whether pack_rows applies: a file type with a packed form (ops.PACKED_QUANT_TYPES), and whole groups of 8 rows
    (of every sub-matrix of `rows` rows, e.g. one expert of a stack, when given)."""
    n = w.shape[0] if rows is None else rows
    return not w.packed and _packed_id(w.qtype) is not None and n > 0 and w.shape[0] % n == 0 and n % 8 == 0


def pack_rows(w: QuantizedWeight) -> QuantizedWeight:
    """The same matrix in its row-interleaved form (csrc/ops/quant.h, PackLayout): group g = rows
    8g..8g+7, unit u = their blocks u with each leading fp16 field as 8 halves, then the other
    bytes in 32-byte chunks of 4 bytes per row, then each ending fp16 field (Q6_K's d) as 8 halves.
    Same bytes; InvalidRequest where can_pack is false."""
    from kog.ops import PACKED_QUANT_TYPES

    if not can_pack(w):
        raise InvalidRequest(f"pack_rows: a {w.type_name} matrix of {w.shape[0]} rows has no packed form "
                             f"({', '.join(t[:-3] for t in PACKED_QUANT_TYPES)} in whole groups of 8 rows)")
    packed = _packed_id(w.qtype)
    front, body, back, block = _layout(packed)
    n, row_bytes = w.data.shape
    b = w.data.view(n // 8, 8, row_bytes // block, block).transpose(1, 2)  # [G, nb, 8 rows, block]

    def halves(part):  # [G, nb, 8, 2 h] -> [G, nb, h * 8 * 2]: each field as 8 halves
        return part.reshape(*b.shape[:3], -1, 2).transpose(2, 3).reshape(*b.shape[:2], -1)

    chunks = b[..., 2 * front:2 * front + body].reshape(*b.shape[:3], body // 4, 4).transpose(2, 3)  # [G, nb, chunk, 8, 4]
    unit = torch.cat([halves(b[..., :2 * front]), chunks.reshape(*b.shape[:2], -1), halves(b[..., 2 * front + body:])],
                     dim=2)
    return QuantizedWeight(unit.reshape(n, row_bytes).contiguous(), packed, w.cols)


def unpack_rows(w: QuantizedWeight) -> QuantizedWeight:
    """pack_rows inverted: the file form of a packed matrix."""
    from kog.ops import quant_file_type

    if not w.packed:
        return w
    front, body, back, block = _layout(w.qtype)
    n, row_bytes = w.data.shape
    u = w.data.view(n // 8, row_bytes // block, 8 * block)  # [G, nb, unit]

    def rows_of(part, fields):  # [G, nb, fields * 8 * 2] -> [G, nb, 8, fields * 2]
        return part.reshape(*u.shape[:2], fields, 8, 2).transpose(2, 3).reshape(*u.shape[:2], 8, -1)

    f, c = 16 * front, 8 * body
    chunks = u[..., f:f + c].reshape(*u.shape[:2], body // 4, 8, 4).transpose(2, 3)  # [G, nb, 8, chunk, 4]
    blocks = torch.cat([rows_of(u[..., :f], front), chunks.reshape(*u.shape[:2], 8, -1), rows_of(u[..., f + c:], back)],
                       dim=3)
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
