"""Continuous batching at token granularity.

Each step decodes every running sequence that has one token to compute, then spends what is
left of the token budget on prefill chunks: first of sequences already prefilling, then of
waiting ones admitted in priority, then arrival, order. When the KV cache runs out, the
allocator itself evicts cached blocks and swaps suspended sequences; if a decode still cannot
get a block, the lowest-priority, latest running sequence is preempted (its KV freed, to be
recomputed later). A request is never dropped for lack of memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kog.engine.sequence import Sequence, SeqStatus
from kog.errors import KVCacheFull
from kog.kvcache import KVCacheManager, KVMoves


@dataclass
class PrefillWork:
    seq: Sequence
    start: int          # first token of the chunk (== tokens already in the cache)
    n: int              # tokens in the chunk: all_ids[start:start + n]
    slots: np.ndarray   # [n] int64


@dataclass
class SchedulerOutput:
    decode: list[Sequence] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    prefill: list[PrefillWork] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """Decides what each engine step computes and keeps the KV allocator in step with it.

    Args:
        kv: the block allocator.
        apply_moves: performs a KVMoves' copies on the KV tensors; called right after the
            allocator call that produced them, so copies happen in allocation order.
        max_num_seqs: most running sequences.
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
    """

    def __init__(self, kv: KVCacheManager, apply_moves: Callable[[KVMoves], None],
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512) -> None:
        self.kv = kv
        self.apply_moves = apply_moves
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    # ---- public API ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self.waiting.sort(key=_order)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV the caller already set up (a fork of a running one)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Removes a sequence (finished or aborted) and releases its KV."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.kv:
            self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in sorted((s for s in self.running if s.num_to_compute == 1), key=_order):
            if seq.status is not SeqStatus.RUNNING or budget <= 0:
                continue  # preempted while making room for an earlier one
            slot = self._append_decode(seq, out)
            if slot is not None:
                out.decode.append(seq)
                out.decode_slots.append(slot)
                budget -= 1
        for seq in sorted((s for s in self.running if s.num_to_compute > 1), key=_order):
            if budget <= 0:
                break
            work = self._append_chunk(seq, budget)
            if work is None:
                break
            out.prefill.append(work)
            budget -= work.n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            work = self._append_chunk(seq, budget)
            if work is None:  # admitted (sharing cached blocks) but no room for a chunk yet
                break
            out.prefill.append(work)
            budget -= work.n
        return out

    # ---- internal helpers ---------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> bool:
        """Creates seq's KV from its longest cached prefix. Only blocks registered in earlier
        steps can hit (their KV is computed); at least one token is left to compute, for logits."""
        ids = seq.all_ids
        bs = self.kv.block_size
        hit = self.kv.lookup(ids)
        if hit >= len(ids):
            hit -= bs
        try:
            cached, moves = self.kv.add_sequence(seq.seq_id, ids[:hit])
        except KVCacheFull:
            return False
        self.apply_moves(moves)
        seq.num_computed = cached
        seq.num_cached_tokens = min(cached, len(seq.prompt_ids))
        return True

    def _append_chunk(self, seq: Sequence, budget: int) -> PrefillWork | None:
        start = seq.num_computed
        n = min(seq.num_to_compute, budget)
        while n > 0:
            try:
                moves = self.kv.append(seq.seq_id, tokens=seq.all_ids[start : start + n])
            except KVCacheFull:
                n //= 2  # a smaller chunk may fit; the rest waits for blocks to free up
                continue
            self.apply_moves(moves)
            return PrefillWork(seq, start, n, np.asarray(moves.slots, dtype=np.int64))
        return None

    def _append_decode(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        while True:
            try:
                moves = self.kv.append(seq.seq_id, tokens=[seq.all_ids[-1]])
            except KVCacheFull:
                victim = max((s for s in self.running if s.num_computed > 0), key=_order)
                self._preempt(victim, out)
                if victim is seq:
                    return None
                continue
            self.apply_moves(moves)
            return int(moves.slots[0])

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Frees seq's KV and queues it again; it will recompute all_ids (nothing is lost)."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.insert(0, seq)
        out.preempted.append(seq)
        if seq in out.decode:
            i = out.decode.index(seq)
            out.decode.pop(i)
            out.decode_slots.pop(i)


def _order(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival_time, seq.seq_id)
