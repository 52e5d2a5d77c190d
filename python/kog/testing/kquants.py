"""Q5_K and Q6_K encoders for tests: gguf-py decodes these formats but cannot encode them.

Plain rounding fits (not llama.cpp's iterative scale search), enough to build real models and
matrices whose dequantized values the kernels must reproduce. Layouts: csrc/ops/quant.h
(BlockQ5_K, BlockQ6_K), i.e. llama.cpp's block_q5_K / block_q6_K; checked against gguf's decoder
in tests/cpu/test_gguf_write.py. (Q4_K's encoder is kog.loader.gguf_write.quantize_q4_k.)
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _super_blocks(x: np.ndarray, name: str) -> np.ndarray:
    if x.shape[-1] % QK_K:
        raise ValueError(f"{name} needs rows of a multiple of {QK_K} values, got {x.shape[-1]}")
    return x.reshape(-1, QK_K).astype(np.float32)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Q5_K blocks of x [..., k] f32 (k a multiple of 256): uint8 [..., k / 256 * 176].

    As quantize_q4_k with q in [0, 31]: per 32-value sub-block the affine fit of its min (<= 0)
    and max, 6-bit scales and mins against fp16 d and dmin; the low 4 bits of q as Q4_K's nibbles,
    the fifth bit of value 32 j + l as bit j of qh[l]."""
    lead = x.shape[:-1]
    sub = _super_blocks(x, "Q5_K").reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale, mins = (sub.max(-1) - lo) / 31.0, -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.rint(mins / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((sub + (dminf * m)[..., None]) / step), 0)
    q = q.clip(0, 31).astype(np.uint8)  # [n, 8, 32]
    scales = np.empty((sub.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    qh = np.zeros((sub.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    low = q & 15
    pairs = low.reshape(-1, 4, 2, 32)  # per 64 values: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    halves = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)], axis=1)
    return np.concatenate([halves, scales, qh, qs], axis=1).reshape(*lead, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of x [..., k] f32 (k a multiple of 256): uint8 [..., k / 256 * 210].

    Per 16-value group j an int8 scale sc_j against the super-block's fp16 d (|x| <= 31 d sc_j),
    q = rint(x / (d sc_j)) + 32 in [0, 63]. Value 128 h + 32 t + l: low 4 bits in nibble t // 2 of
    ql[64 h + 32 (t % 2) + l], high 2 bits in bits 2 t, 2 t + 1 of qh[32 h + l]; then scales, d."""
    lead = x.shape[:-1]
    blocks = _super_blocks(x, "Q6_K")
    groups = blocks.reshape(-1, 16, 16)
    scale = np.abs(groups).max(-1) / 31.0  # [n, 16]: q - 32 in [-31, 31]
    d = (scale.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(-128, 127).astype(np.int8)
        step = (df * sc.astype(np.float32))[..., None]
        q = np.where(step != 0, np.rint(groups / step), 0) + 32
    q = q.clip(0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, h, t, l]
    ql = np.zeros((blocks.shape[0], 2, 2, 32), np.uint8)  # [n, h, t % 2, l]
    qh = np.zeros((blocks.shape[0], 2, 32), np.uint8)
    for t in range(4):
        ql[:, :, t % 2] |= (q[:, :, t] & 15) << (4 * (t // 2))
        qh |= (q[:, :, t] >> 4) << (2 * t)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                          axis=1).reshape(*lead, -1)
