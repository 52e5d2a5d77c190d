"""4-bit weights for the GPU decode kernel (issue 17): kog._C.WEIGHT_Q4_GROUPS and WEIGHT_Q4_K
(csrc/schedule/program.h, csrc/gpu/decode/int4.cuh).

Both keep 4-bit codes q in [0, 15] in one layout: a row of k elements is k / 32 groups of 16
bytes, byte j of a group holding element j (low nibble) and j + 16 (high nibble) -- GGUF's Q4_0 /
Q4_1 block order -- so the GEMV reads one group per 16-byte load. Element e is scale * q + min:

    WEIGHT_Q4_GROUPS  (scale, min) an f16 pair per group of 32: groups uint8 [rows, k / 32 * 4].
                      From Q4_0 (min = -8 scale), Q4_1 (its own pairs), and so GPTQ / AWQ
                      checkpoints (kog.loader.int4_checkpoint makes them Q4_0 / Q4_1).
    WEIGHT_Q4_K       GGUF Q4_K's 16-byte super-block headers as the file holds them: groups uint8
                      [rows, k / 256 * 16]; group j of a super-block: scale d * sc_j, min -dmin * m_j.

Every value is the format's exactly: scale * q is exact in f32 (11 + 6 + 4 bits), so
`dequantize` and the kernel (fma(q, scale, min)) round once, identically.

    w4 = from_quantized(qw)            # a QuantizedWeight of type Q4_0 / Q4_1 / Q4_K
    w4.dequantize()                    # f32 [rows, cols]: the CPU reference of the GPU format
    gpu = to_gpu_weights(program, weights, torch.bfloat16)   # what GpuDecoder runs
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kog import _C
from kog.errors import InvalidRequest
from kog.quantized import QuantizedWeight

log = logging.getLogger(__name__)

GROUP = 32       # elements per group (one 16-byte vector of codes)
SUPER = 256      # elements per Q4_K super-block (one 16-byte header)
KINDS = {_C.WEIGHT_Q4_GROUPS: "Q4_GROUPS", _C.WEIGHT_Q4_K: "Q4_K"}


@dataclass(frozen=True)
class Int4Weight:
    """codes: uint8 [rows, cols / 2]; groups: uint8 [rows, cols / 32 * 4] (WEIGHT_Q4_GROUPS) or
    [rows, cols / 256 * 16] (WEIGHT_Q4_K); both contiguous, on one device."""

    codes: torch.Tensor
    groups: torch.Tensor
    kind: int
    cols: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"4-bit weight kind {self.kind} is not one of {KINDS}")
        unit = SUPER if self.kind == _C.WEIGHT_Q4_K else GROUP
        per = 16 if self.kind == _C.WEIGHT_Q4_K else 4
        rows = self.codes.shape[0] if self.codes.dim() == 2 else -1
        if self.cols <= 0 or self.cols % unit:
            raise InvalidRequest(f"{KINDS[self.kind]} weight: {self.cols} columns, not a multiple of {unit}")
        for name, t, width in (("codes", self.codes, self.cols // 2), ("groups", self.groups, self.cols // unit * per)):
            if t.dtype != torch.uint8 or t.dim() != 2 or tuple(t.shape) != (rows, width) or not t.is_contiguous():
                raise InvalidRequest(f"{KINDS[self.kind]} weight of {self.cols} columns: {name} must be contiguous "
                                     f"uint8 [rows, {width}], got {t.dtype} {tuple(t.shape)}")
        if self.groups.device != self.codes.device:
            raise InvalidRequest("4-bit weight: codes and groups on different devices")

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [rows, cols] shape of the matrix."""
        return (int(self.codes.shape[0]), self.cols)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.groups.numel()

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def type_name(self) -> str:
        return KINDS[self.kind]

    def data_ptr(self) -> int:
        return self.codes.data_ptr()

    def to(self, device) -> Int4Weight:
        return Int4Weight(self.codes.to(device), self.groups.to(device), self.kind, self.cols)

    def dequantize(self) -> torch.Tensor:
        """f32 [rows, cols]: every element scale * q + min, rounded once (the kernel's values)."""
        rows = self.shape[0]
        codes = self.codes.cpu().numpy().reshape(rows, -1, 16)
        q = np.concatenate([codes & 0x0F, codes >> 4], axis=2).astype(np.float32)  # [rows, groups, 32]
        scale, minimum = self._affines()
        return torch.from_numpy((q * scale[..., None] + minimum[..., None]).reshape(rows, self.cols))

    def dequantize_rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """f32 [stop - start, cols] of rows [start, stop), computed with torch on the weight's own
        device (what GPU prefill multiplies with; `dequantize` is its NumPy reference, the same
        values bit for bit: scale * q is exact, + min rounds once)."""
        stop = self.shape[0] if stop is None else stop
        codes = self.codes[start:stop]
        rows = codes.shape[0]
        c = codes.reshape(rows, -1, 16)
        q = torch.cat([c & 0x0F, c >> 4], dim=2).float()  # [rows, groups, 32]
        scale, minimum = self._affines_torch(self.groups[start:stop])
        return (q * scale[..., None] + minimum[..., None]).reshape(rows, self.cols)

    def _affines_torch(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, min) f32 [rows, cols / 32] of the groups bytes g [rows, ...] (as _affines)."""
        rows = g.shape[0]
        if self.kind == _C.WEIGHT_Q4_GROUPS:
            pairs = g.contiguous().view(torch.float16).reshape(rows, -1, 2).float()
            return pairs[..., 0], pairs[..., 1]
        head = g.reshape(rows, -1, 16)
        d = head[..., 0:2].contiguous().view(torch.float16)[..., 0].float()  # [rows, super-blocks]
        dmin = head[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        sc, mn = q4_k_scale_mins_torch(head[..., 4:16])
        return (d[..., None] * sc).reshape(rows, -1), -(dmin[..., None] * mn).reshape(rows, -1)

    def _affines(self) -> tuple[np.ndarray, np.ndarray]:
        """(scale, min) f32 [rows, cols / 32] of every group."""
        rows = self.shape[0]
        g = self.groups.cpu().numpy()
        if self.kind == _C.WEIGHT_Q4_GROUPS:
            pairs = g.view(np.float16).reshape(rows, -1, 2).astype(np.float32)
            return pairs[..., 0], pairs[..., 1]
        head = g.reshape(rows, -1, 16)
        d = head[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, super-blocks]
        dmin = head[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        sc, mn = q4_k_scale_mins(head[..., 4:16])
        return ((d[..., None] * sc).reshape(rows, -1), -(dmin[..., None] * mn).reshape(rows, -1))


def q4_k_scale_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q4_K's 6-bit (sc_j, m_j), j = 0..7, as f32 [..., 8] each, from its 12 scale bytes [..., 12]
    (llama.cpp's get_scale_min_k4)."""
    sc, mn = q4_k_scale_mins_torch(torch.from_numpy(np.ascontiguousarray(scales, dtype=np.uint8)))
    return sc.numpy(), mn.numpy()


def q4_k_scale_mins_torch(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k_scale_mins over a uint8 tensor [..., 12] on any device: f32 [..., 8] each."""
    q = scales.to(torch.int32)
    sc = torch.cat([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def from_quantized(w: QuantizedWeight) -> Int4Weight:
    """The GPU 4-bit form of a Q4_0, Q4_1 or Q4_K matrix in its file layout, holding the same values.

    Raises:
        InvalidRequest: another type, a packed (row-interleaved) form, or a Q4_0 scale whose min
            (-8 d) leaves f16's range.
    """
    name = w.type_name
    rows = w.shape[0]
    data = w.data.cpu().numpy()
    if name == "Q4_0":
        blocks = data.reshape(rows, -1, 18)
        d = blocks[..., 0:2].copy().view(np.float16)
        with np.errstate(over="ignore"):
            m = (d.astype(np.float32) * -8.0).astype(np.float16)
        if not np.isfinite(m).all():
            raise InvalidRequest("Q4_0 weight: a block scale times -8 leaves float16's range")
        groups = np.concatenate([d, m], axis=2).view(np.uint8)
        codes = blocks[..., 2:]
        kind = _C.WEIGHT_Q4_GROUPS
    elif name == "Q4_1":
        blocks = data.reshape(rows, -1, 20)
        groups, codes, kind = blocks[..., 0:4], blocks[..., 4:], _C.WEIGHT_Q4_GROUPS
    elif name == "Q4_K":
        blocks = data.reshape(rows, -1, 144)
        groups = blocks[..., 0:16]
        qs = blocks[..., 16:].reshape(rows, -1, 4, 2, 16)  # [rows, sb, pair, first/second 16 bytes, 16]
        lo_first, lo_second = qs[..., 0, :] & 0x0F, qs[..., 1, :] & 0x0F  # sub-block 2p: elements l, l + 16
        hi_first, hi_second = qs[..., 0, :] >> 4, qs[..., 1, :] >> 4      # sub-block 2p + 1
        even = lo_first | (lo_second << 4)
        odd = hi_first | (hi_second << 4)
        codes = np.stack([even, odd], axis=3)  # [rows, sb, pair, 2, 16]: groups in order 2p, 2p + 1
        kind = _C.WEIGHT_Q4_K
    else:
        raise InvalidRequest(f"{name} weight: the GPU 4-bit formats take Q4_0, Q4_1 and Q4_K matrices (file layout)")
    to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1).astype(np.uint8, copy=False))
    return Int4Weight(to_t(codes), to_t(groups), kind, w.cols)


# The ggml types from_quantized takes.
GPU_4BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def to_gpu_weights(program, weights: dict, dtype: torch.dtype) -> dict:
    """The weights the GPU decode kernel runs for `program` (kog.program Instructions): each
    Q4_0 / Q4_1 / Q4_K QuantizedWeight read only by LINEAR ops becomes an Int4Weight; every other
    QuantizedWeight (an embedding, a tied head, Q8_0 / Q5_* / Q6_K matrices) is dequantized to
    `dtype`, the count logged. A new dict on the weights' device; other entries as given."""
    from kog.program import Opcode

    readers: dict[str, set] = {}
    for ins in program:
        for name in ins.weights:
            readers.setdefault(name, set()).add(ins.opcode)
    out, widened = {}, []
    for name, w in weights.items():
        if not isinstance(w, QuantizedWeight):
            out[name] = w
        elif readers.get(name) == {Opcode.LINEAR} and w.type_name in GPU_4BIT_TYPES:
            out[name] = from_quantized(w).to(w.device)
        else:
            out[name] = w.with_data(w.data.cpu()).dequantize().to(w.device, dtype)
            widened.append(f"{name} ({w.type_name})")
    if widened:
        log.info("GPU decode: %d quantized matrices run dequantized to %s (no 4-bit GPU form): %s", len(widened),
                 str(dtype).removeprefix("torch."), ", ".join(widened))
    return out
