"""gguf.quants.dequantize, which Kog relies on, checked against plain re-implementations of
ggml's block layouts on random blocks, and against quantize -> dequantize round trips."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

Q = gguf.GGMLQuantizationType


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)  # [n, 1]


def ref_q8_0(b):  # d: f16, qs: int8[32]
    return _f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)


def ref_q4_0(b):  # d: f16, qs: u8[16] -> low nibbles are x[0:16], high nibbles x[16:32]; offset 8
    qs = b[:, 2:].astype(np.int32)
    return _f16(b, 0) * (np.concatenate([qs & 15, qs >> 4], axis=1) - 8)


def ref_q4_1(b):  # d: f16, m: f16, qs: u8[16]; x = d * q + m
    qs = b[:, 4:].astype(np.int32)
    return _f16(b, 0) * np.concatenate([qs & 15, qs >> 4], axis=1) + _f16(b, 2)


def _k4_scale_min(scales: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """6-bit scale and min of sub-block j, packed in 12 bytes (ggml's get_scale_min_k4)."""
    s = scales.astype(np.int32)
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return (s[:, j + 4] & 15) | ((s[:, j - 4] >> 6) << 4), (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)


def ref_q4_k(b):  # d, dmin: f16; scales: u8[12]; qs: u8[128] for 256 values in 8 sub-blocks of 32
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), b[:, 4:16], b[:, 16:].astype(np.int32)
    out = np.empty((b.shape[0], 256), np.float32)
    for i in range(4):  # each 32 bytes of qs hold 64 values: low nibbles then high nibbles
        q = qs[:, 32 * i:32 * i + 32]
        for half, nib in enumerate((q & 15, q >> 4)):
            sc, mn = _k4_scale_min(scales, 2 * i + half)
            out[:, 64 * i + 32 * half:64 * i + 32 * half + 32] = d * sc[:, None] * nib - dmin * mn[:, None]
    return out


def ref_q6_k(b):  # ql: u8[128], qh: u8[64], scales: i8[16], d: f16 -- 256 6-bit values, offset 32
    ql, qh = b[:, :128].astype(np.int32), b[:, 128:192].astype(np.int32)
    sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _f16(b, 208)
    out = np.empty((b.shape[0], 256), np.float32)
    for n in range(2):  # two halves of 128 values
        l_lo, l_hi, h = ql[:, 64 * n:64 * n + 32], ql[:, 64 * n + 32:64 * n + 64], qh[:, 32 * n:32 * n + 32]
        quads = [(l_lo & 15) | ((h & 3) << 4), (l_hi & 15) | (((h >> 2) & 3) << 4),
                 (l_lo >> 4) | (((h >> 4) & 3) << 4), (l_hi >> 4) | (((h >> 6) & 3) << 4)]
        for k, q in enumerate(quads):
            for half in range(2):  # one int8 scale per 16 values
                lane = slice(16 * half, 16 * half + 16)
                scale = sc[:, 8 * n + 2 * k + half][:, None]
                out[:, 128 * n + 32 * k + 16 * half:128 * n + 32 * k + 16 * half + 16] = d * scale * (q[:, lane] - 32)
    return out


REFERENCES = {Q.Q8_0: ref_q8_0, Q.Q4_0: ref_q4_0, Q.Q4_1: ref_q4_1, Q.Q4_K: ref_q4_k, Q.Q6_K: ref_q6_k}


def _random_blocks(qtype, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes whose f16 fields hold finite, modest values."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    f16_offsets = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q4_K: [0, 2], Q.Q6_K: [208]}[qtype]
    for off in f16_offsets:
        b[:, off:off + 2] = rng.uniform(-0.05, 0.05, size=(n, 1)).astype(np.float16).view(np.uint8)
    return b


@pytest.mark.parametrize("qtype", list(REFERENCES), ids=lambda q: q.name)
def test_dequantize_matches_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    blocks = _random_blocks(qtype, 64, rng)
    want = REFERENCES[qtype](blocks).reshape(-1)
    got = gguf.quants.dequantize(blocks.reshape(1, -1), qtype).reshape(-1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# gguf-py has no quantizer for the K formats; the references above cover their decoding.
@pytest.mark.parametrize("qtype,tol", [(Q.Q8_0, 0.01), (Q.Q4_0, 0.15), (Q.Q4_1, 0.1), (Q.BF16, 0.01),
                                       (Q.F16, 0.001)], ids=lambda x: getattr(x, "name", x))
def test_quantize_dequantize_round_trip(qtype, tol):
    """Error relative to the largest value stays below each format's resolution."""
    x = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32)
    if qtype == Q.F16:
        y = gguf.quants.dequantize(x.astype(np.float16), qtype)
    else:
        y = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
    assert y.shape == x.shape
    assert np.abs(y - x).max() / np.abs(x).max() < tol
