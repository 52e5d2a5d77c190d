"""How fast is the paged KV allocator through the binding?

Prints one table. Baselines measured in the same run:
  * block ops: batched calls vs one binding call per sequence (the unbatched baseline);
  * fork: 128k-token context vs 1k-token context (target: within 2x), plus KV bytes copied;
  * prefix lookup of a 4k-token prompt vs hashing nothing (an empty prompt: binding overhead).

Usage: PYTHONPATH=python python bench/kv_cache.py
"""

from __future__ import annotations

import time

import numpy as np

from kog.kvcache import KVCacheManager

BS = 16


def block_ops(n_seqs: int, batched: bool) -> tuple[float, int]:
    """Seconds for add + append (1 block each) + fork + free of n_seqs sequences; block ops."""
    m = KVCacheManager(4 * n_seqs, BS)
    ids = np.arange(n_seqs, dtype=np.int64)
    kids = ids + n_seqs
    for s in ids:  # setup (not timed): empty sequences
        m.add_sequence(int(s), [])
    t0 = time.perf_counter()
    if batched:
        m.append_batch(ids, np.full(n_seqs, BS, np.int64))   # n_seqs block allocations
        m.fork_batch(ids, kids)                              # n_seqs shares
        m.free_batch(np.concatenate([ids, kids]))            # n_seqs block frees
    else:
        for s in ids:
            m.append(int(s), n_tokens=BS)
        for s in ids:
            m.fork(int(s), int(s) + n_seqs)
        for s in np.concatenate([ids, kids]):
            m.free(int(s))
    dt = time.perf_counter() - t0
    assert m.stats()["blocks_used"] == 0
    return dt, 3 * n_seqs


def fork_time(context: int, n_forks: int = 2000) -> tuple[float, int]:
    """Mean seconds per fork of a `context`-token sequence; KV bytes the forks asked to copy."""
    m = KVCacheManager(context // BS + 8, BS)
    m.add_sequence(0, np.arange(context, dtype=np.int32))
    t0 = time.perf_counter()
    for c in range(1, n_forks + 1):
        m.fork(0, c)
    dt = (time.perf_counter() - t0) / n_forks
    copies = m.stats()["cow_copies"]  # forks never copy: CoW happens only on a later write
    return dt, copies


def lookup_time(n_tokens: int, reps: int = 200) -> float:
    m = KVCacheManager(n_tokens // BS + 8, BS, namespace="bench")
    prompt = np.random.default_rng(0).integers(0, 50000, n_tokens, dtype=np.int32)
    m.add_sequence(0, prompt)
    assert m.lookup(prompt) == n_tokens // BS * BS
    t0 = time.perf_counter()
    for _ in range(reps):
        m.lookup(prompt)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    n = 100_000
    rows = []
    tb, ops = min(block_ops(n, True) for _ in range(3))
    tu, _ = block_ops(n, False)
    rows.append(("append+fork+free, batched (100k seqs)", f"{ops / tb / 1e6:.2f} M block ops/s",
                 f"{tu / tb:.1f}x vs per-call binding ({ops / tu / 1e6:.2f} M/s)"))
    f1k, c1 = min(fork_time(1024) for _ in range(5))
    f128k, c128 = min(fork_time(128 * 1024) for _ in range(5))
    rows.append(("fork, 1k-token context", f"{f1k * 1e6:.2f} us", "baseline"))
    rows.append(("fork, 128k-token context", f"{f128k * 1e6:.2f} us", f"{f128k / f1k:.2f}x vs 1k"))
    rows.append(("KV bytes copied at fork", f"{(c1 + c128)} CoW copies = 0 B", "target 0"))
    l0 = lookup_time(0)
    l4k = lookup_time(4096)
    rows.append(("prefix lookup, 4k-token prompt (256 blocks hit)", f"{l4k * 1e6:.1f} us",
                 f"{l4k / l0:.1f}x vs empty prompt ({l0 * 1e6:.2f} us)"))
    w = max(len(r[0]) for r in rows)
    print(f"| {'case'.ljust(w)} | result | vs baseline |")
    print(f"|{'-' * (w + 2)}|---|---|")
    for r in rows:
        print(f"| {r[0].ljust(w)} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    main()
