"""Speculative decoding in the engine step: draft k tokens, verify them in one target forward.

The engine calls `take` on the scheduler's output: every decoding sequence whose request asks
for speculation (and gets a non-empty draft) leaves the batched decode and becomes a verify
chunk [last token, d_1 .. d_k]; `run` computes all chunks in one `runner.verify` call, accepts
a prefix per sequence (greedy: exactly greedy decoding; sampled: rejection sampling, exactly
the target's distribution), appends it, and truncates the KV to what was accepted.

NOTE: between steps the allocator holds exactly `seq.num_computed` tokens of every running
sequence (the scheduler appends the last token's slot when it schedules a decode). `take`
appends the draft's slots on top; `run` truncates back to the new num_computed, so rejected
drafts never outlive their step. The grammar is never advanced through a draft
(`Constraint.draft_masks` leaves it unchanged): only the tokens appended to the sequence are
consumed, so KV and grammar roll back together by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import numpy as np
import torch

from kog.engine import structured
from kog.engine.chunks import forward_chunks
from kog.engine.outputs import StreamDelta
from kog.engine.sequence import Sequence
from kog.errors import InvalidOperation, InvalidRequest, KVCacheFull
from kog.kvcache import KVCacheManager, KVMoves
from kog.models.runner import PrefillChunk
from kog.sampling_params import SamplingParams
from kog.speculation.ngram import NgramDrafter
from kog.speculation.verify import Verified, rejection_sample, target_probs, verify_greedy


@dataclass
class VerifyWork:
    seq: Sequence
    draft: list[int]                # k >= 1 draft tokens
    draft_probs: torch.Tensor | None  # [k, V] sampled draft-model distributions; None: deterministic draft
    slots: np.ndarray               # int64 [k + 1]: the last token's slot, then the draft's


class Speculator:
    """Draft-and-verify for the speculating sequences of each step.

    Args:
        runner: the target model (needs `verify(chunks)`: logits of every chunk position).
        kv: the engine's block allocator.
        apply_moves: performs an allocator call's copies.
        eos_token_ids: the model's stop tokens (drafts are cut before them).
        max_model_len: the engine's context limit.
    """

    def __init__(self, runner, kv: KVCacheManager, apply_moves: Callable[[KVMoves], None],
                 eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.runner = runner
        self.kv = kv
        self.apply_moves = apply_moves
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.drafter = None  # DraftModelDrafter for method "draft", set by use_draft_model
        self._drafting: dict[int, Sequence] = {}  # sequences holding draft-model state (until finish)
        self.stats = {"steps": 0, "drafted": 0, "accepted": 0}

    # ---- public API ---------------------------------------------------------------------------
    def use_draft_model(self, runner, max_seqs: int) -> None:
        """Drafts for method "draft" requests with this small model (same tokenizer as the target).

        Args:
            runner: the draft model's ModelRunner; its whole KV cache becomes draft slabs.
            max_seqs: sequences that may hold draft state at once (use the engine's max_num_seqs).
        """
        from kog.speculation.draft_model import DraftModelDrafter

        if runner.vocab_size != self.runner.vocab_size:
            raise InvalidRequest(f"the draft model's vocabulary ({runner.vocab_size}) differs from the "
                                 f"target's ({self.runner.vocab_size})")
        self.drafter = DraftModelDrafter(runner, max_seqs)

    def check(self, params: SamplingParams) -> None:
        """InvalidRequest when a request asks for draft-model speculation and there is no draft model."""
        if params.speculative is not None and params.speculative.method == "draft" and self.drafter is None:
            raise InvalidRequest("speculative.method 'draft' needs a draft model "
                                 "(kog.LLM(..., speculative_model=...) / --speculative-model)")

    def finish(self, seq: Sequence) -> None:
        """Frees a finished or aborted sequence's draft-model state."""
        if self._drafting.pop(seq.seq_id, None) is not None:
            self.drafter.release(seq.seq_id)

    def take(self, decode: list[Sequence], slots: list[int]) -> list[VerifyWork]:
        """Moves the sequences that speculate this step out of the decode batch (in place).

        Args:
            decode: the step's decoding sequences (one token to compute each).
            slots: their scheduled cache slots, parallel to decode.

        Returns:
            One VerifyWork per speculating sequence, its draft's slots allocated.
        """
        work: list[VerifyWork] = []
        keep: list[tuple[Sequence, int]] = []
        for seq, slot in zip(decode, slots):
            w = self._draft(seq, slot)
            if w is None:
                keep.append((seq, slot))
            else:
                work.append(w)
        decode[:] = [s for s, _ in keep]
        slots[:] = [slot for _, slot in keep]
        return work

    def run(self, work: Seq[VerifyWork], append: Callable[[Sequence, int], StreamDelta],
            after: Callable[[Sequence, StreamDelta], StreamDelta]) -> list[StreamDelta]:
        """Verifies every draft in one target forward and appends the accepted tokens.

        Args:
            work: from `take`.
            append: appends one token to a sequence like a sampled one (stop checks, grammar).
            after: called with each unfinished sequence's merged delta (jump-forward).

        Returns:
            One delta per sequence: every token it gained this step.
        """
        if not work:
            return []
        chunks = [PrefillChunk([w.seq.token_ids[-1]] + w.draft, w.seq.num_computed,
                               self.kv.block_table(w.seq.seq_id), w.slots) for w in work]
        logits = forward_chunks(self.runner, chunks, all_logits=True)  # per chunk: [k + 1, V]
        deltas = []
        for w, rows in zip(work, logits):
            seq = w.seq
            seq.num_forward_passes += 1
            v = self._verify(w, rows)
            self.stats["steps"] += 1
            self.stats["drafted"] += len(w.draft)
            self.stats["accepted"] += v.num_accepted
            seq.num_computed += 1 + v.num_accepted  # the last token and the accepted drafts have KV now
            delta = None
            for i, token in enumerate(v.tokens):
                if i == v.num_accepted:  # the target's own token: checked like a sampled one
                    token = structured.fit_token(seq, token, rows[i], self.eos_token_ids, self.max_model_len)
                d = append(seq, token)
                delta = d if delta is None else StreamDelta(d.request_id, d.index, delta.text + d.text,
                                                            delta.token_ids + d.token_ids, d.finish_reason)
                if seq.finish_reason is not None:
                    break
            if not seq.is_finished:  # a finished sequence's blocks are already freed
                self.kv.truncate(seq.seq_id, seq.num_computed)
                delta = after(seq, delta)
            deltas.append(delta)
        return deltas

    # ---- internal helpers ---------------------------------------------------------------------
    def _draft(self, seq: Sequence, slot: int) -> VerifyWork | None:
        """Proposes, trims and allocates seq's draft; None when seq decodes plainly this step."""
        p = seq.params
        if (p.speculative is None or p.logprobs is not None or p.repetition_penalty != 1.0
                or p.presence_penalty or p.frequency_penalty or len(seq.output_ids) < p.min_tokens):
            return None  # penalties and min_tokens are per position; logprobs come from the sampler
        budget = self.max_model_len - seq.num_tokens - 1  # room for the drafts plus one target token
        if p.max_tokens is not None:
            budget = min(budget, p.max_tokens - len(seq.output_ids) - 1)
        k = min(p.speculative.num_tokens, budget)
        if k < 1:
            return None
        draft, probs = self._propose(seq, k)
        stops = set(self.eos_token_ids) | set(p.stop_token_ids)
        # Cut before any stop token (the target may still emit it) and where the grammar refuses:
        # verification rows past a stop have no distribution.
        n = next((i for i, t in enumerate(draft) if t in stops), len(draft))
        if seq.constraint is not None and n:
            n = seq.constraint.num_allowed(draft[:n])
            n = structured.fitting_prefix(seq, draft[:n], self.max_model_len)  # a tool call keeps room to close
        draft = draft[:n]
        if not draft:
            return None
        try:
            moves = self.kv.append(seq.seq_id, tokens=draft)
        except KVCacheFull:
            return None  # no room for the draft: decode one token as scheduled
        self.apply_moves(moves)
        slots = np.concatenate([[slot], np.asarray(moves.slots, dtype=np.int64)]).astype(np.int64)
        return VerifyWork(seq, draft, None if probs is None else probs[:n], slots)

    def _propose(self, seq: Sequence, k: int) -> tuple[list[int], torch.Tensor | None]:
        sp = seq.params.speculative
        if sp.method == "ngram":
            return NgramDrafter(sp.ngram_max, sp.ngram_min).propose(seq.token_ids, k), None
        try:
            d = self.drafter.propose(seq.seq_id, seq.token_ids, k, seq.params.temperature, seq.generator,
                                     seq.constraint)
        except InvalidOperation:  # every draft slab is taken: this sequence decodes plainly
            return [], None
        self._drafting[seq.seq_id] = seq
        return d.tokens, d.probs

    def _verify(self, w: VerifyWork, rows: torch.Tensor) -> Verified:
        """rows [k + 1, V]: the target's logits after the last token and after each draft token."""
        seq = w.seq
        masks = seq.constraint.draft_masks(w.draft) if seq.constraint is not None else None  # [k + 1, V]
        if seq.params.greedy:
            x = rows.float()
            if masks is not None:
                x = x.masked_fill(~masks.to(x.device), float("-inf"))
            return verify_greedy(x, w.draft)
        return rejection_sample(target_probs(rows, seq.params, masks), w.draft, w.draft_probs, seq.generator)
