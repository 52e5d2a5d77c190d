"""Timing helpers shared by the CPU kernel benchmarks (bench/cpu_linear.py, bench/quant_gemv.py)."""

from __future__ import annotations

import time
from typing import Callable

import torch


def best_seconds(fn: Callable[[], object], repeat: int, rounds: int) -> float:
    """Best mean seconds per call over `rounds` rounds of `repeat` calls, after one warm-up call:
    the minimum is what stays reproducible on a shared machine."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


def triad_gbps(floats: int, repeat: int, rounds: int) -> float:
    """Memory bandwidth of a = b + 2c over three arrays of `floats` f32 (GB/s, 3 arrays counted)."""
    a, b, c = torch.empty(floats), torch.rand(floats), torch.rand(floats)
    t = best_seconds(lambda: torch.add(b, c, alpha=2.0, out=a), repeat, rounds)
    return 3 * floats * 4 / t / 1e9
