"""Random paged KV caches for kernel tests: one layer's cache, shuffled block tables, lengths."""

from __future__ import annotations

import numpy as np
import torch


def random_paged_cache(gen: torch.Generator, seq_lens: list[int], n_kv_heads: int, head_dim: int,
                       block_size: int, dtype: torch.dtype, spare_blocks: int = 3, spare_columns: int = 1,
                       pad: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache whose sequences own non-contiguous blocks of a shuffled pool.

    Returns:
        cache: [blocks needed + spare_blocks, 2, n_kv_heads, block_size, head_dim] random, in dtype.
        table: [len(seq_lens), most blocks needed + spare_columns] int32, padded with `pad`.
        seq_lens: [len(seq_lens)] int32.
    """
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    cache = torch.randn(num_blocks, 2, n_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.full((len(seq_lens), max(need) + spare_columns), pad, dtype=torch.int32)
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = ids[at:at + n]
        at += n
    return cache, table, torch.tensor(seq_lens, dtype=torch.int32)


def random_prefill_case(gen: torch.Generator, q_lens: list[int], seq_lens: list[int], n_q_heads: int,
                        n_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, pad: int = -1):
    """A prefill launch: chunk i is the last q_lens[i] of seq_lens[i] cached tokens.

    Returns:
        (q [sum(q_lens), n_q_heads, head_dim], cache, table, seq_lens, query_start_loc
        [len(q_lens) + 1] int32), cache and table as random_paged_cache (3 spare blocks, 1 column).
    """
    cache, table, lens = random_paged_cache(gen, seq_lens, n_kv_heads, head_dim, block_size, dtype, pad=pad)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), n_q_heads, head_dim, generator=gen).to(dtype)
    return q, cache, table, lens, qsl
