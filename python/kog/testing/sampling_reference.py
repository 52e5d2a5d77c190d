"""A plain numpy statement of the native sampler's rules (csrc/ops/sample.h), to test it against.

Thresholds are float32 as on the GPU (the same bisection midpoints); masses are float64 as in the
CPU kernel. Written for clarity: every probe scans the whole vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_MASK = (1 << 64) - 1


def uniform01(seed: int, counter: int) -> float:
    """splitmix64 of (seed, counter), top 24 bits, in [0, 1)."""
    z = (seed * 0x9E3779B97F4A7C15 + counter + 0x632BE59BD9B4E019) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return float(np.float32(z >> 40) * np.float32(1.0 / 16777216.0))


def penalize(x: np.ndarray, seen: Sequence[int], output: Sequence[int], banned: Sequence[int],
             repetition: float, presence: float, frequency: float) -> np.ndarray:
    """x [V] float32 -> copy with banned ids at -inf, then the repetition penalty on the distinct
    ids of `seen` (prompt + output), then presence/frequency on the ids of `output`."""
    x = x.astype(np.float32).copy()
    f32 = np.float32
    for t in banned:
        x[t] = -np.inf
    if repetition != 1.0:
        for t in set(seen):
            x[t] = x[t] / f32(repetition) if x[t] > 0 else x[t] * f32(repetition)
    if presence != 0.0 or frequency != 0.0:
        ids, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
        for t, c in zip(ids, counts):
            x[t] = (x[t] - f32(frequency) * f32(c)) - f32(presence)
    return x


def _bisect(measure, lo: np.float32, hi: np.float32, target: float) -> np.float32:
    for _ in range(40):
        if not hi > lo:
            break
        mid = np.float32(np.float32(0.5) * (lo + hi))
        if mid <= lo or mid >= hi:
            break
        if measure(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def sample_row(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
               seed: int, counter: int) -> int:
    """One token from float32 logits x [V] (already penalized) by the kernel's rules."""
    x = np.asarray(x, dtype=np.float32)
    vocab = x.shape[0]
    arg = int(np.argmax(x))  # first index of the max
    best = x[arg]
    finite = x[x > -np.inf]
    if not temperature > 0 or finite.size == 0:
        return arg
    lowest = finite.min()
    temp = np.float32(temperature)
    inv_temp = np.float32(np.float32(1.0) / temp)

    def weights(mask: np.ndarray) -> np.ndarray:
        return np.exp((x[mask] - best) * inv_temp).astype(np.float64)

    lo = lowest
    if 0 < top_k < vocab:
        lo = _bisect(lambda t: int((x >= t).sum()), lowest, best, float(top_k))
    if min_p > 0:
        lo = max(lo, np.float32(best + np.float32(np.log(np.float32(min_p))) * temp))
    if top_p < 1:
        total = weights(x >= lo).sum()
        lo = _bisect(lambda t: weights(x >= t).sum(), lo, best, float(np.float32(top_p)) * total)
    lo = min(lo, best)
    kept = x >= lo
    w = np.zeros(vocab, dtype=np.float64)
    w[kept] = weights(kept)
    u = uniform01(seed, counter) * w.sum()
    run = np.cumsum(w)
    hits = np.nonzero((run > u) & kept)[0]
    return int(hits[0]) if hits.size else arg
