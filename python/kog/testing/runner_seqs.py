"""Sequences on a ModelRunner for model tests: each owns a disjoint, contiguous block range
(the allocator is tested elsewhere), so prefill and decode calls need no KV manager."""

from __future__ import annotations

import numpy as np
import torch

from kog.models import ModelRunner, PrefillChunk


class RunnerSeqs:
    """Sequence i owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq) of the runner."""

    def __init__(self, runner: ModelRunner, blocks_per_seq: int = 48):
        self.r, self.n = runner, blocks_per_seq

    def table(self, i: int) -> np.ndarray:
        return np.arange(i * self.n, (i + 1) * self.n, dtype=np.int32)

    def slots(self, i: int, start: int, end: int) -> np.ndarray:
        """Cache slots of positions [start, end) of sequence i."""
        bs, pos = self.r.block_size, np.arange(start, end)
        return self.table(i)[pos // bs].astype(np.int64) * bs + pos % bs

    def chunk(self, i: int, tokens, start: int = 0) -> PrefillChunk:
        return PrefillChunk(list(tokens), start, self.table(i), self.slots(i, start, start + len(tokens)))

    def decode(self, ids, tokens, positions) -> torch.Tensor:
        """One decode step of sequences ids, token t at position p each."""
        positions = np.asarray(positions)
        return self.r.decode(np.asarray(tokens), positions, np.stack([self.table(i) for i in ids]),
                             (positions + 1).astype(np.int32),
                             np.concatenate([self.slots(i, p, p + 1) for i, p in zip(ids, positions)]))
