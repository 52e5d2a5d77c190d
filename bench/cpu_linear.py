"""Decode-batch linear on the CPU: Kog's kernel vs torch.nn.functional.linear, same weights.

Prints one table: per shape and batch, µs per call, weight GB/s, and the ratio to torch; plus the
machine's memory bandwidth measured in the same run (a STREAM-style triad over three 64 MiB arrays).
Usage: python bench/cpu_linear.py [--repeat N]
"""

from __future__ import annotations

import argparse

import torch

from kog import _C, ops

from bench_timing import best_seconds, triad_gbps

SHAPES = [  # (name, n, k): SmolLM2-135M and Llama-3.2-1B projection shapes
    ("smollm2 q_proj", 576, 576),
    ("smollm2 gate_up", 2 * 1536, 576),
    ("smollm2 down", 576, 1536),
    ("smollm2 lm_head", 49152, 576),
    ("llama1b gate_up", 2 * 8192, 2048),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    bw = triad_gbps(64 * 2**20 // 4, repeat=5, rounds=3)
    print(f"kog cpu_isa={_C.build_info()['cpu_isa']} threads={_C.build_info()['cpu_threads']} "
          f"torch threads={torch.get_num_threads()}  triad bandwidth {bw:.1f} GB/s\n")
    print(f"{'shape':<18}{'dtype':<10}{'m':>3}{'kog µs':>10}{'torch µs':>10}{'kog GB/s':>10}{'of triad':>9}{'speedup':>9}")
    for name, n, k in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            w = torch.randn(n, k).to(dtype)
            for m in (1, 4):
                x = torch.randn(m, k).to(dtype)
                out = torch.empty(m, n, dtype=dtype)
                t_kog = best_seconds(lambda: ops.linear(x, w, out=out), args.repeat, rounds=3)
                t_torch = best_seconds(lambda: torch.nn.functional.linear(x, w), args.repeat, rounds=3)
                gbps = w.numel() * w.element_size() / t_kog / 1e9
                print(f"{name:<18}{str(dtype)[6:]:<10}{m:>3}{t_kog*1e6:>10.1f}{t_torch*1e6:>10.1f}"
                      f"{gbps:>10.1f}{gbps/bw:>9.0%}{t_torch/t_kog:>8.2f}x")


if __name__ == "__main__":
    main()
