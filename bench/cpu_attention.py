"""CPU paged attention: Kog's kernels vs torch SDPA over the same K/V already gathered dense.

Question: how fast is decode attention at batch 1 over long contexts (memory bound: the KV read
rate is the figure of merit), a 512-token prompt prefill, and the verification of 8 speculated
tokens at the end of a 16k context, against torch's own CPU attention?
Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), block_size 16, one layer.
The torch baseline gets a dense [1, H, L, D] K/V (its gather is not timed), so it is the bar to
beat rather than an equal-footing paged implementation.

Usage: PYTHONPATH=python python bench/cpu_attention.py [--dtypes bfloat16,float32] [--iters N] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kog import _C, ops

HQ, HK, D, BS = 32, 8, 128, 16


def timeit(fns: dict, iters: int) -> dict:
    """Best seconds per call of each fn, the fns interleaved call by call.

    Interleaving gives every contender the same background load; the minimum, not the median,
    is what stays reproducible on a shared VM where other jobs steal whole time slices.
    """
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            if name in _C.cpu_isas_supported():
                _C.set_cpu_isa(name)
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def make_case(seq_len: int, dtype: torch.dtype):
    n_blocks = -(-seq_len // BS)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(n_blocks + 8, 2, HK, BS, D, generator=g).to(dtype)
    table = torch.randperm(n_blocks + 8, generator=g)[:n_blocks].to(torch.int32)[None]
    blocks = cache[table[0].long()]  # [n, 2, HK, BS, D]
    k = blocks[:, 0].permute(1, 0, 2, 3).reshape(1, HK, -1, D)[:, :, :seq_len].contiguous()
    v = blocks[:, 1].permute(1, 0, 2, 3).reshape(1, HK, -1, D)[:, :, :seq_len].contiguous()
    return cache, table, torch.tensor([seq_len], dtype=torch.int32), k, v


def bench_decode(seq_len: int, dtype: torch.dtype, iters: int) -> dict:
    cache, table, lens, k, v = make_case(seq_len, dtype)
    q = torch.randn(1, HQ, D).to(dtype)
    out = torch.empty_like(q)
    fns = {isa: lambda: ops.paged_attention_decode(q, cache, table, lens, out=out, validate_indices=False)
           for isa in _C.cpu_isas_supported()}
    q4 = q.view(1, HQ, 1, D)
    fns["torch"] = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
    row = timeit(fns, iters)
    row["rate"] = 2 * seq_len * HK * D * cache.element_size() / 1e9  # GB of K and V read
    return row


def bench_prefill(n: int, dtype: torch.dtype, iters: int, context: int = 0) -> dict:
    """n query tokens at the end of a context of max(n, context) tokens, causal."""
    seq_len = max(n, context)
    cache, table, lens, k, v = make_case(seq_len, dtype)
    q = torch.randn(n, HQ, D).to(dtype)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    out = torch.empty_like(q)
    fns = {isa: lambda: ops.paged_attention_prefill(q, cache, table, lens, qsl, out=out, validate_indices=False)
           for isa in _C.cpu_isas_supported()}
    q4 = q.transpose(0, 1)[None]  # [1, HQ, n, D]
    # Bottom-right causal mask (SDPA's is_causal aligns top-left when q is shorter than k).
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]
    fns["torch"] = lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True)
    row = timeit(fns, iters)
    row["rate"] = 4 * HQ * D * n * (seq_len - (n - 1) / 2) / 1e9  # GFLOP of the causal QK^T and PV
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="threads for Kog and torch alike (0 = default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        _C.set_cpu_num_threads(args.threads)  # Kog's own pool
    default_isa = _C.build_info()["cpu_isa"]  # the best this CPU supports
    isas = _C.cpu_isas_supported()
    print(f"threads={torch.get_num_threads()} isas={isas} torch={torch.__version__}")
    print(f"Hq={HQ} Hkv={HK} D={D} block_size={BS}; best of {args.iters} interleaved calls; "
          "rate = GB/s of K/V read (decode) or GFLOP/s (prefill, verify), for the default ISA")
    cols = "".join(f"{'kog ' + i + ' us':>16}" for i in isas)
    print(f"{'case':<22}{cols}{'rate':>10}{'torch us':>12}{'torch/kog':>11}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        short = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}[name]
        cases = [(f"decode b1 {L // 1024}k {short}", lambda L=L: bench_decode(L, dtype, args.iters)) for L in (1024, 4096, 16384)]
        cases.append((f"prefill 512 {short}", lambda: bench_prefill(512, dtype, max(3, args.iters // 3))))
        cases.append((f"verify 8 @16k {short}", lambda: bench_prefill(8, dtype, args.iters, context=16384)))
        for label, run in cases:
            row = run()
            best = row[default_isa]
            times = "".join(f"{row[i] * 1e6:>16.1f}" for i in isas)
            print(f"{label:<22}{times}{row['rate'] / best:>10.2f}{row['torch'] * 1e6:>12.1f}{row['torch'] / best:>11.2f}")
    _C.set_cpu_isa(default_isa)


if __name__ == "__main__":
    main()
