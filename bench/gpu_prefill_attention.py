"""GPU prefill attention: the flash-style kernel vs the split (FlashDecoding) kernel, same run.

Question: how much faster is the tiled prefill kernel than one block per (query token, head,
256-token partition), for whole prompts and for a chunk over a long cached context? torch's
SDPA over the same K/V already gathered dense (its gather not timed) is printed as the bar.
Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), block_size 16, one layer.

Usage: PYTHONPATH=python python bench/gpu_prefill_attention.py [--dtype bfloat16] [--iters N]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kog import ops

from decode_latency import timed_us  # bench/ is on sys.path when run as a script

HQ, HK, D, BS = 32, 8, 128, 16
CASES = [(128, 128), (512, 512), (2048, 2048), (512, 8192)]  # (q_len, seq_len): prompts, a chunk


def best_ms(fn, iters: int) -> float:
    """Fastest of `iters` calls, each timed with device events."""
    return min(timed_us(fn, iters)) / 1e3


def case(q_len: int, seq_len: int, dtype: torch.dtype, dev: torch.device):
    g = torch.Generator().manual_seed(0)
    n_blocks = -(-seq_len // BS)
    cache = torch.randn(n_blocks + 8, 2, HK, BS, D, generator=g).to(dtype=dtype, device=dev)
    table = torch.randperm(n_blocks + 8, generator=g)[:n_blocks].to(torch.int32)[None].to(dev)
    q = torch.randn(q_len, HQ, D, generator=g).to(dtype=dtype, device=dev)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    blocks = cache[table[0].long()]  # [n, 2, HK, BS, D]
    kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, HK, -1, D)[:, :, :seq_len]  # [2, HK, L, D]
    return q, cache, table, lens, qsl, kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dtype, dev = getattr(torch, args.dtype), torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, Hq {HQ} Hk {HK} D {D} block {BS}, best of {args.iters}")
    print(f"{'q_len':>6} {'seq_len':>8} {'split ms':>9} {'flash ms':>9} {'sdpa ms':>8} {'split/flash':>12} {'flash/sdpa':>11}")
    for q_len, seq_len in CASES:
        q, cache, table, lens, qsl, kv = case(q_len, seq_len, dtype, dev)
        run = {k: (lambda k=k: ops.paged_attention_prefill(q, cache, table, lens, qsl, validate_indices=False,
                                                           kernel=k)) for k in ("split", "flash")}
        # SDPA's causal mask is top-left aligned: give it the whole [seq_len] query range only
        # for prompts; for a chunk, an explicit bottom-right mask.
        qt = q.transpose(0, 1)[None]  # [1, HQ, q_len, D]
        k, v = (t.repeat_interleave(HQ // HK, 0)[None] for t in kv)
        pos = torch.arange(seq_len - q_len, seq_len, device=dev)[:, None]
        mask = torch.arange(seq_len, device=dev)[None, :] <= pos
        run["sdpa"] = lambda: F.scaled_dot_product_attention(qt, k, v, attn_mask=mask)
        ms = {name: best_ms(fn, args.iters) for name, fn in run.items()}
        print(f"{q_len:>6} {seq_len:>8} {ms['split']:>9.3f} {ms['flash']:>9.3f} {ms['sdpa']:>8.3f} "
              f"{ms['split'] / ms['flash']:>12.2f} {ms['flash'] / ms['sdpa']:>11.2f}")


if __name__ == "__main__":
    main()
