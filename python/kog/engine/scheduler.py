"""Continuous batching at token granularity, and what happens when KV memory runs out.

Each step decodes every running sequence that has one token to compute, then spends what is
left of the token budget on prefill chunks: first of sequences already prefilling, then of
waiting ones admitted in priority, then arrival, order.

Memory policy, in order, when a block is needed and none is free:
  1. the allocator evicts unpinned prefix-cache blocks (LRU first);
  2. the allocator swaps suspended sequences (idle sessions, swap-preempted sequences) to the
     host pool, oldest suspension first (needs num_host_blocks > 0);
  3. a decode preempts the lowest-priority, latest running sequence: swapped to the host pool
     when it fits there (resumed bit-exact later), else its KV is freed and recomputed;
  4. before preempting itself, it frees the KV of idle sessions (oldest first; they recompute
     their context on their next generation).
If a step could schedule nothing although work is queued, the same reclaim order runs until
something fits. A request is never dropped for lack of memory; only pinned prefixes filling the
whole pool raise KVCacheFull.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kog.engine.sequence import Sequence, SeqStatus
from kog.errors import KVCacheFull
from kog.kvcache import KVCacheManager, KVMoves, KVState


@dataclass
class PrefillWork:
    seq: Sequence
    start: int          # first token of the chunk (== tokens already in the cache)
    n: int              # tokens in the chunk: seq.token_ids[start:start + n]
    slots: np.ndarray   # [n] int64


@dataclass
class SchedulerOutput:
    decode: list[Sequence] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)
    prefill: list[PrefillWork] = field(default_factory=list)
    prefilled: list[Sequence] = field(default_factory=list)  # prefill-only, done at admission
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.prefilled


class Scheduler:
    """Decides what each engine step computes and keeps the KV allocator in step with it.

    Args:
        kv: the block allocator.
        apply_moves: performs a KVMoves' copies on the KV tensors; called right after the
            allocator call that produced them, so copies happen in allocation order.
        max_num_seqs: most running sequences.
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        enable_prefix_caching: admit new sequences with their longest cached prefix.
    """

    def __init__(self, kv: KVCacheManager, apply_moves: Callable[[KVMoves], None],
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 enable_prefix_caching: bool = True) -> None:
        self.kv = kv
        self.apply_moves = apply_moves
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # NOTE: finished session sequences whose KV is kept, suspended in the allocator, oldest
        # first; seq.num_computed is the session's number of tokens with KV (0 once dropped).
        self.parked: dict[int, Sequence] = {}

    # ---- public API ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queues seq; if the allocator already holds its KV (a session), admission resumes it."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self.waiting.sort(key=_order)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV the caller already set up (a fork of a running one)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Removes a sequence (finished or aborted) and releases its KV."""
        self._remove(seq)
        if seq.seq_id in self.kv:
            self.kv.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def park(self, seq: Sequence) -> None:
        """Ends seq's request but keeps its KV for a session: out of the batch, suspended in the
        allocator (so memory pressure may swap it to the host pool or, last, drop it)."""
        self._remove(seq)
        if seq.seq_id in self.kv and self.kv.state(seq.seq_id) is KVState.RUNNING:
            self.kv.suspend(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        self.parked[seq.seq_id] = seq

    def unpark(self, seq: Sequence) -> None:
        """Takes a parked sequence's KV back (to queue a new request on it, or to free it)."""
        del self.parked[seq.seq_id]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plans one step; every allocator call's copies are applied before it returns.

        Raises KVCacheFull only when nothing can run even after reclaiming all KV but pins.
        """
        out = SchedulerOutput()
        self._fill(out)
        # NOTE: every reclaim frees one sequence's tokens, and re-admission can take some back;
        # the bound makes a pool held by pins an error instead of a hang.
        tries = 2 * (len(self.parked) + len(self.waiting) + len(self.running)) + 2
        while out.empty and self.has_work():
            tries -= 1
            if tries < 0 or not self._reclaim(out):
                raise KVCacheFull("no sequence fits in the KV cache: pinned prefixes hold it; "
                                  "close sessions or give the engine more KV memory")
            self._fill(out)
        return out

    # ---- internal helpers ---------------------------------------------------------------------
    def _fill(self, out: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens
        preempted = len(out.preempted)
        decoding = sorted((s for s in self.running if s.num_to_compute == 1 and not s.prefill_only), key=_order)
        self._append_decodes(decoding[:budget], out)
        budget -= len(out.decode)
        decoded = {id(s) for s in out.decode}
        for seq in sorted((s for s in self.running if s.num_to_prefill > 0 and id(s) not in decoded), key=_order):
            if budget <= 0:
                break
            work = self._append_chunk(seq, budget)
            if work is None:
                break
            out.prefill.append(work)
            budget -= work.n
        # NOTE: no admission after a decode preempted: the victim would only be swapped or
        # recomputed straight back in, in place of the work that needed its blocks.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(out.preempted) == preempted:
            seq = self.waiting[0]
            # NOTE: a victim of this step waits for the next one: re-admitted now it would take
            # back the blocks its preemption freed (all of them when it only shared a prefix),
            # and reclaiming would pick it again and again instead of the next victim.
            if any(seq is victim for victim in out.preempted) or not self._admit(seq):
                break
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.num_to_prefill == 0:  # a session prefix whose KV was all cached
                out.prefilled.append(seq)
                continue
            work = self._append_chunk(seq, budget)
            if work is None:  # admitted (sharing cached blocks) but no room for a chunk yet
                break
            out.prefill.append(work)
            budget -= work.n

    def _admit(self, seq: Sequence) -> bool:
        """Gives seq its KV: resumes KV the allocator kept (a session, a swapped preemption), or
        starts from the longest cached prefix (none while prompt logprobs are pending). Only
        blocks registered in earlier steps can hit (their KV is computed); at least one token is
        left to compute, for logits."""
        if seq.seq_id in self.kv:
            try:
                moves = self.kv.resume(seq.seq_id)
            except KVCacheFull:
                return False
            self.apply_moves(moves)
            return True
        ids = seq.token_ids
        # NOTE: prompt logprobs come from the prefill's logits, so such a prompt is computed whole.
        hit = self.kv.lookup(ids) if self.enable_prefix_caching and not seq.prompt_logprobs_pending else 0
        if hit >= len(ids):
            hit -= self.kv.block_size
        try:
            cached, moves = self.kv.add_sequence(seq.seq_id, ids[:hit])
        except KVCacheFull:
            return False
        self.apply_moves(moves)
        seq.num_computed = cached
        seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
        return True

    def _append_chunk(self, seq: Sequence, budget: int) -> PrefillWork | None:
        """The next prefill chunk of seq: as many of its tokens as the budget and the KV allow
        (the rest waits for blocks to free up); None if not one token fits."""
        start = seq.num_computed
        n = min(seq.num_to_prefill, budget, self.kv.max_appendable(seq.seq_id))
        if n <= 0:
            return None
        moves = self.kv.append(seq.seq_id, tokens=seq.token_ids[start : start + n])
        self.apply_moves(moves)
        return PrefillWork(seq, start, n, np.asarray(moves.slots, dtype=np.int64))

    def _append_decodes(self, batch: list[Sequence], out: SchedulerOutput) -> None:
        """Gives every sequence of batch (in _order) its decode slot with one allocator call.

        While the batch does not fit, the first sequence that does not fit makes room as if the
        batch were appended one by one: the lowest-priority, latest running sequence is
        preempted; when that is the sequence itself, idle sessions' KV is dropped first.
        """
        while batch:
            ids = [s.seq_id for s in batch]
            fit = self.kv.max_appendable_batch(ids, [1] * len(batch))
            if fit == len(batch):
                break
            victim = max((s for s in self.running if s.num_computed > 0), key=_order)
            if victim is batch[fit] and self._drop_parked():
                continue
            self._preempt(victim, out)
            batch = [s for s in batch if s is not victim]
        if not batch:
            return
        moves = self.kv.append_batch([s.seq_id for s in batch], [1] * len(batch),
                                     [s.token_ids[-1] for s in batch])
        self.apply_moves(moves)
        out.decode.extend(batch)
        out.decode_slots.extend(int(x) for x in moves.slots)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Takes seq out of the batch and queues it first: its KV swapped to the host pool if it
        fits there (resumed as is), else freed (it recomputes its tokens). Nothing is lost."""
        self.running.remove(seq)
        if seq in out.decode:
            i = out.decode.index(seq)
            out.decode.pop(i)
            out.decode_slots.pop(i)
            self.kv.truncate(seq.seq_id, seq.num_computed)  # drop this step's unfed slot
        if not self._swap_out(seq):
            self.kv.free(seq.seq_id)
            seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.insert(0, seq)
        out.preempted.append(seq)

    def _swap_out(self, seq: Sequence) -> bool:
        if self.kv.num_host_blocks == 0:
            return False
        self.kv.suspend(seq.seq_id)
        try:
            moves = self.kv.swap_out(seq.seq_id)
        except KVCacheFull:
            return False
        self.apply_moves(moves)
        return True

    def _drop_parked(self) -> bool:
        """Frees the KV of the oldest idle session (it recomputes later); False if none has KV."""
        for seq in self.parked.values():
            if self._holds_kv(seq):
                self.kv.free(seq.seq_id)
                seq.num_computed = 0
                return True
        return False

    def _reclaim(self, out: SchedulerOutput) -> bool:
        """Frees KV so a step that scheduled nothing can: idle sessions first, then queued
        sequences holding KV (latest first), then the lowest-priority running sequence."""
        if self._drop_parked():
            return True
        for seq in reversed(self.waiting):
            if self._holds_kv(seq):
                self.kv.free(seq.seq_id)
                seq.num_computed = 0
                return True
        holding = [s for s in self.running if self._holds_kv(s)]
        if holding:
            victim = max(holding, key=_order)
            self.running.remove(victim)
            self.kv.free(victim.seq_id)
            victim.num_computed = 0
            victim.status = SeqStatus.WAITING
            self.waiting.insert(0, victim)
            out.preempted.append(victim)
            return True
        return False

    def _holds_kv(self, seq: Sequence) -> bool:
        return seq.seq_id in self.kv and self.kv.num_tokens(seq.seq_id) > 0

    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)


def _order(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival_time, seq.seq_id)
