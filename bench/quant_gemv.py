"""Quantized GEMV on the CPU: kog's linear_quant per GGUF type vs kog's f32 and bf16 linear.

SmolLM2-135M projection shapes, one row of x (batch-1 decode). Prints µs per call, GB/s of weight
bytes read, the fraction of the machine's triad bandwidth (measured in the same run) and the speed-up
over the f32 linear on the same shape. K-quants need k % 256 == 0: "-" where the shape does not allow
it (llama.cpp writes such tensors of a Q4_K_M file in another type). Both kernels are called
through kog._C directly: the time of the kernel as the decode executor will pay it, without the
~15 µs of argument checks in kog.ops (the same for both).
Each type with a row-interleaved form (kog.quantized.pack_rows, what the CPU runner holds) is
timed in both layouts: "Q4_1" the file's, "Q4_1_R8" the packed one. x is quantized in
--x-stages int8 stages (2, the decode program's, by default).
Usage: python bench/quant_gemv.py [--repeat N] [--m M] [--x-stages S]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from kog import _C, ops
from kog.quantized import QuantizedWeight, can_pack, pack_rows

from bench_timing import best_seconds, triad_gbps

SHAPES = [  # (name, n, k) of W [n, k]
    ("q_proj 576x576", 576, 576),
    ("up 1536x576", 1536, 576),
    ("down 576x1536", 576, 1536),
    ("lm_head 49152x576", 49152, 576),
]
QTYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def random_blocks(rng: np.random.Generator, name: str, n: int, k: int) -> torch.Tensor:
    """[n, row_bytes] uint8 of valid blocks (random integers, finite fp16 scales): timing only."""
    qtype = GGMLQuantizationType[name]
    elems, nbytes = quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    halves = rng.uniform(-0.05, 0.05, size=(n, k // elems, 2)).astype(np.float16).view(np.uint8)
    halves = halves.reshape(n, k // elems, 4)
    if name == "Q6_K":
        blocks[..., nbytes - 2:] = halves[..., :2]
    elif name in ("Q8_0", "Q4_0", "Q5_0"):
        blocks[..., :2] = halves[..., :2]
    else:
        blocks[..., :4] = halves
    return torch.from_numpy(blocks.reshape(n, -1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--m", type=int, default=1, help="rows of x")
    parser.add_argument("--x-stages", type=int, default=2, choices=[1, 2])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    bw = triad_gbps(64 * 2**20, repeat=3, rounds=5)
    info = _C.build_info()
    print(f"kog cpu_isa={info['cpu_isa']} threads={info['cpu_threads']} m={args.m} x_stages={args.x_stages}  "
          f"triad bandwidth {bw:.1f} GB/s\n")
    print(f"{'shape':<20}{'weights':<9}{'MB':>7}{'µs':>9}{'GB/s':>8}{'of triad':>9}{'vs f32':>8}{'vs bf16':>8}")
    for name, n, k in SHAPES:
        x = torch.randn(args.m, k)
        t_base = {}
        rows = []
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(n, k).to(dtype)
            xd, out = x.to(dtype), torch.empty(args.m, n, dtype=dtype)
            code = ops.DTYPE_CODE[dtype]
            t = best_seconds(lambda: _C.linear(out.data_ptr(), xd.data_ptr(), w.data_ptr(), 0, args.m, n, k, k, n,
                                               code, -1), args.repeat, rounds=5)
            t_base[dtype] = t
            rows.append((str(dtype)[6:], w.numel() * w.element_size(), t))
        for q in QTYPES:
            elems = ops.QUANT_TYPES[q][1]
            if k % elems:
                rows.append((q, None, None))
                continue
            qw = QuantizedWeight(random_blocks(rng, q, n, k), ops.QUANT_TYPES[q][0], k)
            for form in [qw] + ([pack_rows(qw)] if can_pack(qw) else []):
                w, type_id, out = form.data, form.qtype, torch.empty(args.m, n)
                ops.linear_quant(x, w, type_id, out=out, x_stages=args.x_stages)  # checks the arguments once
                t = best_seconds(lambda: _C.linear_quant(out.data_ptr(), x.data_ptr(), w.data_ptr(), w.numel(), args.m,
                                                         n, k, k, n, 0, type_id, args.x_stages), args.repeat, rounds=5)
                rows.append((form.type_name, w.numel(), t))
        for wname, nbytes, t in rows:
            if t is None:
                print(f"{name:<20}{wname:<9}{'-':>7}")
                continue
            gbps = nbytes / t / 1e9
            print(f"{name:<20}{wname:<9}{nbytes / 1e6:>7.2f}{t * 1e6:>9.1f}{gbps:>8.1f}{gbps / bw:>9.0%}"
                  f"{t_base[torch.float32] / t:>7.2f}x{t_base[torch.bfloat16] / t:>7.2f}x")


if __name__ == "__main__":
    main()
