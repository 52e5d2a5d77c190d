"""Drafting with a small model that shares the target's tokenizer (SmolLM2-135M for a larger
SmolLM2, Qwen2.5-0.5B for a larger Qwen2.5).

The draft model has its own ModelRunner and KV cache. Each sequence owns a fixed slab of the
draft cache's blocks and the drafter remembers which tokens' K/V are in it, so a proposal only
prefills what changed since the last one (the tokens accepted or corrected by the target) and
the K/V of rejected draft tokens is simply overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from kog.errors import InvalidOperation, InvalidRequest
from kog.models.runner import ModelRunner, PrefillChunk
from kog.sampler import draw, one_thread

if TYPE_CHECKING:
    from kog.structured_output.grammar import Constraint


@dataclass
class Draft:
    """Proposed tokens and the distributions they were drawn from."""

    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V] f32 draft distributions; None: greedy (one-hot q)


class DraftModelDrafter:
    """Proposes k tokens per call by running the draft model autoregressively.

    Args:
        runner: the draft model's runner; the drafter owns its whole KV cache.
        max_seqs: sequences that may hold draft state at once (the cache is split evenly).
    """

    def __init__(self, runner: ModelRunner, max_seqs: int):
        num_blocks = runner.kv.kv.shape[1]  # kv: [layers, blocks, 2, kv_heads, block_size, head_dim]
        if not 1 <= max_seqs <= num_blocks:
            raise InvalidRequest(f"max_seqs must be in [1, {num_blocks}] (draft KV blocks), got {max_seqs}")
        self.runner = runner
        self.blocks_per_seq = num_blocks // max_seqs
        self.capacity = min(self.blocks_per_seq * runner.block_size, runner.max_model_len)  # tokens per seq
        self._free = list(range(max_seqs - 1, -1, -1))  # slab indices, popped from the end
        self._slab: dict[int, int] = {}  # seq id -> slab index
        self._cached: dict[int, list[int]] = {}  # seq id -> tokens whose K/V the slab holds, in order

    # ------------------------------------------------------------------ public API

    def propose(self, seq_id: int, ids: Sequence[int], k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None, constraint: Constraint | None = None) -> Draft:
        """Drafts up to k tokens after ids.

        Args:
            seq_id: the engine's sequence id (draft state is kept per id until `release`).
            ids: the whole sequence so far (prompt + output).
            k: most tokens to draft; fewer near the draft cache's capacity or where the grammar stops.
            temperature: 0 drafts the argmax; > 0 samples from softmax(logits / temperature).
            generator: the request's generator for sampled drafts.
            constraint: the sequence's grammar; drafts obey it, and its state is unchanged on return.

        Returns:
            Draft with its tokens and, when sampled, their distributions.
        """
        ids = [int(t) for t in ids]
        k = min(k, self.capacity - len(ids))
        if not ids or k < 1:
            return Draft([], None if temperature == 0 else torch.empty(0, self.runner.vocab_size))
        slab = self._slab_of(seq_id)
        cached = self._cached[seq_id]
        # Reuse the cached prefix, but always feed the last token: its logits start the draft.
        reuse = _common_prefix(cached, ids, limit=len(ids) - 1)
        logits = self.runner.prefill([self._chunk(slab, ids[reuse:], reuse)])[0]  # [V]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for j in range(k):
            if constraint is not None:
                if constraint.is_stopped():
                    break
                logits = constraint.mask_logits(logits)
            if temperature == 0:
                tokens.append(int(logits.argmax()))
            else:
                with one_thread():
                    probs.append(torch.softmax(logits / temperature, dim=-1))
                tokens.append(draw(probs[-1], generator))
            if constraint is not None:
                constraint.advance(tokens[-1])
            if j + 1 < k:
                logits = self._decode(slab, tokens[-1], len(ids) + j)
        if constraint is not None:
            constraint.rollback(len(tokens))
        # NOTE: the last draft token was never fed, so its K/V is not in the slab.
        self._cached[seq_id] = ids + tokens[:-1]
        return Draft(tokens, None if temperature == 0 else torch.stack(probs) if probs
                     else torch.empty(0, self.runner.vocab_size))

    def release(self, seq_id: int) -> None:
        """Frees a finished sequence's draft slab."""
        if seq_id not in self._slab:
            raise InvalidOperation(f"sequence {seq_id} has no draft state")
        self._free.append(self._slab.pop(seq_id))
        del self._cached[seq_id]

    # ------------------------------------------------------------------ internal helpers

    def _slab_of(self, seq_id: int) -> int:
        if seq_id not in self._slab:
            if not self._free:
                raise InvalidOperation(f"no free draft slab for sequence {seq_id} ({len(self._slab)} in use)")
            self._slab[seq_id] = self._free.pop()
            self._cached[seq_id] = []
        return self._slab[seq_id]

    def _table(self, slab: int) -> np.ndarray:
        return np.arange(slab * self.blocks_per_seq, (slab + 1) * self.blocks_per_seq, dtype=np.int32)

    def _slots(self, slab: int, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        bs = self.runner.block_size
        return self._table(slab)[pos // bs].astype(np.int64) * bs + pos % bs

    def _chunk(self, slab: int, tokens: list[int], start: int) -> PrefillChunk:
        return PrefillChunk(tokens, start, self._table(slab), self._slots(slab, start, start + len(tokens)))

    def _decode(self, slab: int, token: int, pos: int) -> torch.Tensor:
        """Feeds one token at position pos; returns the next token's logits [V]."""
        return self.runner.decode(np.array([token]), np.array([pos]), self._table(slab)[None],
                                  np.array([pos + 1], np.int32), self._slots(slab, pos, pos + 1))[0]


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    stop = min(len(a), len(b), limit)
    while n < stop and a[n] == b[n]:
        n += 1
    return n
