"""Structured output in the engine: one grammar `Constraint` per sequence (kog.structured_output.grammar).

The engine calls these hooks, in step order:

    admit(seq, tokenizer, eos, vocab)   add_request: compile the grammar (InvalidRequest before any token)
    fork(parent)                        _fork_children: each of n > 1 completions gets its own state
    prefetch_masks(seqs)                before the forwards: start the masks on a worker thread
    prepare_masks(seqs)                 before sampling: every constrained row's mask, in parallel
    before_sampling(seqs, max_len)      before sampling: between tool calls, only EOS once no new call fits
    keep_calls_in_budget(seqs, ...)     after sampling: redraw a token that leaves no room to close its call
                                        (speculation: fitting_prefix cuts drafts, fit_token checks the target's token)
    consume(seq, token, eos)            _append_token: advance the grammar; end the sequence at its EOS
    jump_forward(seq, append)           after sampling: append the tokens the grammar forces

NOTE: a constraint always holds exactly the sequence's output tokens (invariant kept by
`consume`, the only place that advances it in the engine), so a preempted sequence keeps its
state and speculation rolls back KV and grammar from the same count.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence as Seq

import torch

from kog.engine.outputs import FinishReason, StreamDelta
from kog.engine.sequence import Sequence
from kog.loader.tokenizer import Tokenizer
from kog.sampler import SampleResult, SampleRow, sample


def admit(seq: Sequence, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
    """Compiles seq.params.structured into seq.constraint (nothing when the output is free).

    Raises:
        InvalidRequest: the schema / grammar / tools do not compile (before any token).
    """
    if seq.params.structured is None:
        return
    from kog.structured_output.grammar import build_constraint  # llguidance only for requests that need it

    seq.constraint = build_constraint(tokenizer, seq.params.structured, eos_token_ids, vocab_size)


def fork(parent: Sequence) -> object | None:
    """An independent copy of parent's grammar state for a sibling completion (None: free)."""
    return None if parent.constraint is None else parent.constraint.fork()


# NOTE: one worker: prefetches run in submission order, so two never touch one constraint at once.
_MASK_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kog-grammar-masks")


class MaskPrefetch:
    """Masks being computed on the worker thread (prefetch_masks); wait() before touching their constraints."""

    def __init__(self, future: Future | None) -> None:
        self._future = future

    def wait(self) -> None:
        """Returns once the masks are in their constraints' caches (idempotent); re-raises the worker's error."""
        future, self._future = self._future, None
        if future is not None:
            future.result()


def prefetch_masks(seqs: Seq[Sequence]) -> MaskPrefetch:
    """Starts computing the allowed-token masks of seqs' constraints on a worker thread, so that
    they overlap the step's forwards (which release the GIL) instead of following them.

    A mask depends only on the tokens a constraint consumed, all known before the forward, so it
    is the mask prepare_masks would compute after it. The caller must not touch these constraints
    (advance, fork, rollback, masks) until MaskPrefetch.wait() returns.
    """
    constraints = [s.constraint for s in seqs if s.constraint is not None]
    if not constraints:
        return MaskPrefetch(None)
    from kog.structured_output.grammar import batch_allowed

    return MaskPrefetch(_MASK_WORKER.submit(batch_allowed, constraints))


def prepare_masks(seqs: Seq[Sequence]) -> None:
    """Computes the allowed-token masks of every constrained sequence about to be sampled, in
    parallel on llguidance's threads; the sampler then reads them from each constraint's cache."""
    constraints = [s.constraint for s in seqs if s.constraint is not None]
    if constraints:
        from kog.structured_output.grammar import batch_allowed

        batch_allowed(constraints)


def before_sampling(seqs: Seq[Sequence], max_model_len: int) -> None:
    """Between tool calls, only EOS once a whole new call would not fit (kog.structured_output.call_budget);
    after prepare_masks."""
    for seq in seqs:
        c = seq.constraint
        if c is not None and c.budget is not None:
            keep = c.budget.before_sampling(c.matcher, c.allowed(), seq.output_ids, remaining(seq, max_model_len))
            if keep is not None:
                c.narrow(keep)


def keep_calls_in_budget(seqs: Seq[Sequence], logits: torch.Tensor, result: SampleResult,
                         sample_row: Callable[[Sequence], SampleRow], max_model_len: int) -> None:
    """Draws again (in place in `result`) each sampled token after which its tool call could not
    be finished within the budget (kog.structured_output.call_budget): from the allowed tokens that only
    close, else the route's token. logits: [len(seqs), V], the rows `result` was sampled from."""
    for k, seq in enumerate(seqs):
        c = seq.constraint
        if c is None or c.budget is None:
            continue
        left = remaining(seq, max_model_len)
        for closers in (True, False):
            if c.budget.fits(c.matcher, seq.output_ids, result.token_ids[k], left):
                break
            keep = c.budget.closing(c.matcher, c.allowed(), seq.output_ids, closers)
            if keep is None:
                break
            c.narrow(keep)
            again = sample(logits[k:k + 1], [sample_row(seq)])
            result.token_ids[k], result.logprobs[k] = again.token_ids[0], again.logprobs[0]
            result.top_logprobs[k] = again.top_logprobs[0]


def fitting_prefix(seq: Sequence, draft: list[int], max_model_len: int) -> int:
    """How many leading draft tokens leave seq's tool call room to finish within the budget
    (kog.structured_output.call_budget; all of them outside a call): speculation drafts no further."""
    c = seq.constraint
    if c is None or c.budget is None or not c.budget.near(remaining(seq, max_model_len) - len(draft)):
        return len(draft)
    twin, out, left = c.fork(), list(seq.output_ids), remaining(seq, max_model_len)
    for i, token in enumerate(draft):
        if not c.budget.fits(twin.matcher, out, token, left - i):
            return i
        twin.advance(token)
        out.append(token)
    return len(draft)


def fit_token(seq: Sequence, token: int, logits: torch.Tensor, eos_token_ids: tuple[int, ...],
              max_model_len: int) -> int:
    """`token`, or a token drawn again from logits [V] as keep_calls_in_budget does: for the
    target's own token after a verified draft."""
    result = SampleResult([token], [None], [None])
    row = lambda s: SampleRow(s.params, s.prompt_ids, s.output_ids, eos_token_ids, s.generator, s.constraint)  # noqa: E731
    keep_calls_in_budget([seq], logits[None], result, row, max_model_len)
    return result.token_ids[0]


def remaining(seq: Sequence, max_model_len: int) -> int:
    """Tokens seq may still generate: max_tokens and the context both bound it."""
    left = max_model_len - seq.num_tokens
    return left if seq.params.max_tokens is None else min(left, seq.params.max_tokens - len(seq.output_ids))


def consume(seq: Sequence, token: int, eos_token_ids: tuple[int, ...]) -> None:
    """Advances seq's grammar by the token just appended to seq.output_ids; when the token is an
    EOS the grammar accepted, the output is complete: the sequence stops (finish reason "stop",
    also under ignore_eos or before min_tokens: the grammar wins)."""
    if seq.constraint is None:
        return
    seq.constraint.advance(token)
    if token in eos_token_ids and seq.finish_reason != "stop":
        seq.finish_reason, seq.stop_reason = FinishReason.STOP, token


def jump_forward(seq: Sequence, append: Callable[[int], StreamDelta], delta: StreamDelta) -> StreamDelta:
    """Appends the tokens seq's grammar forces next, without sampling them.

    They join the sequence's tokens to compute, so the scheduler runs them (with the last
    sampled token) as ONE prefill chunk next step, whose last logits give the next sampled
    token. Skipped for requests asking for logprobs (a forced token has no model distribution
    without a forward of its own) or with structured.jump_forward False.

    Args:
        seq: a sequence whose sampled token was just appended.
        append: appends one token exactly like a sampled one (stop checks, detokenization).
        delta: what the sampled token produced this step.

    Returns:
        delta extended with the forced tokens' text and ids.
    """
    if (seq.constraint is None or seq.finish_reason is not None or seq.params.logprobs is not None
            or not seq.params.structured.jump_forward):
        return delta
    forced = seq.constraint.forced_tokens()
    for token in forced:
        d = append(token)
        delta = StreamDelta(delta.request_id, delta.index, delta.text + d.text, delta.token_ids + d.token_ids,
                            d.finish_reason)
        if seq.finish_reason is not None:  # max_tokens, the context or a stop string cut the run
            break
    return delta
