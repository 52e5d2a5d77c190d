"""The token batch a program runs over: chunks of several sequences, flattened.

Sequence s owns token rows [query_start_loc[s], query_start_loc[s + 1]); its rows sit at
consecutive positions ending at seq_lens[s] - 1 and attend causally to its cache up to their
own position. Decode is the case of one token per sequence, prefill of N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenBatch:
    """Step inputs, all on the device the program runs on."""

    ids: torch.Tensor               # [T] int64 token ids
    positions: torch.Tensor         # [T] int64 each token's position in its sequence
    slots: torch.Tensor             # [T] int64 cache slot of each token (block_id * block_size + offset)
    block_tables: torch.Tensor      # [S, max_blocks] int32, padded; covers seq_lens
    seq_lens: torch.Tensor          # [S] int32 cached tokens per sequence, this batch's included
    query_start_loc: torch.Tensor   # [S + 1] int32, first 0, last T
    sampled_rows: torch.Tensor | None = None  # [R] int64 rows that yield logits; None: every row

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[0]

    @classmethod
    def decode(cls, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               slots: torch.Tensor) -> TokenBatch:
        """One token per sequence, each yielding logits (what the native decode step runs)."""
        n = tokens.shape[0]
        dev = tokens.device
        return cls(ids=tokens.to(torch.int64), positions=positions.to(torch.int64), slots=slots.to(torch.int64),
                   block_tables=block_tables.to(torch.int32), seq_lens=(positions + 1).to(torch.int32),
                   query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev))
