"""The sampler: logits of a batch of sequences -> one token each, per-request parameters.

Order per row (vLLM's): min_tokens masking, repetition/presence/frequency penalties, the grammar
mask of a structured-output request (kog.structured_output), then greedy argmax, or temperature -> top-k ->
top-p -> min-p -> a draw from the request's own generator.
Logprobs are those of the model's raw distribution (log_softmax of the unprocessed logits).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from kog.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kog.structured_output.grammar import Constraint


class PenaltyCounts:
    """One sequence's penalty state, brought up to date with each new token instead of being
    rebuilt from the whole context every step.

    seen:   [V] bool     tokens of the prompt or the output (repetition penalty)
    counts: [V] float32  occurrences in the output (presence and frequency penalties)

    NOTE: the sequence's tokens only grow; sync() counts the prompt once and then only the
    output tokens past num_output, so a step costs O(V + new tokens), not O(context).
    """

    def __init__(self) -> None:
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self.num_output = 0  # output tokens counted so far

    def sync(self, prompt_ids: Sequence[int], output_ids: Sequence[int], vocab: int) -> None:
        """Counts the tokens not counted yet (all of the prompt on the first call)."""
        if self.seen is None:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.counts = torch.zeros(vocab, dtype=torch.float32)
            self._mark(torch.tensor(list(prompt_ids), dtype=torch.long), vocab, count=False)
        n = len(output_ids)
        if n < self.num_output:
            raise ValueError("PenaltyCounts: a sequence's output only grows")
        if n > self.num_output:
            self._mark(torch.tensor(output_ids[self.num_output:], dtype=torch.long), vocab, count=True)
            self.num_output = n

    def apply(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """logits [V] float32 -> penalized copy; equal to apply_penalties on the same tokens."""
        out = logits
        if p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            out = torch.where(self.seen, torch.where(out > 0, out / r, out * r), out)
        if (p.presence_penalty or p.frequency_penalty) and self.num_output:
            c = self.counts
            out = out - p.frequency_penalty * c - p.presence_penalty * (c > 0).to(out.dtype)
        return out

    def _mark(self, ids: torch.Tensor, vocab: int, count: bool) -> None:
        ids = ids[(ids >= 0) & (ids < vocab)]
        self.seen[ids] = True
        if count:
            self.counts.index_put_((ids,), torch.ones(ids.shape[0]), accumulate=True)


def needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


@dataclass
class SampleRow:
    """Per-sequence state the sampler needs besides its logits row."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    eos_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None  # seeded per request; None: torch's default
    constraint: Constraint | None = None  # grammar state of a structured-output request; None: free
    # The sequence's penalty counts, synced and applied incrementally; None: recounted from
    # prompt_ids and output_ids (apply_penalties, O(context): tests and one-off rows).
    penalties: PenaltyCounts | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]  # of the sampled token, None when not asked for
    top_logprobs: list[list[tuple[int, float]] | None]  # best alternatives, most likely first


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch ops inside run on one thread.

    NOTE: a vocabulary row (32k-256k floats) is too small to split: torch parallelizes softmax,
    sort and multinomial above 32k elements, and the fork/join then costs more than the work
    (softmax of 49k logits: 0.1 ms on one thread, 8 ms on two when a core is busy elsewhere).
    The engine runs sampling on its one engine thread, so the global setting is restored
    before any model GEMM runs again.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def single_threaded(fn):
    """Decorator: `fn` runs inside `one_thread()`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with one_thread():
            return fn(*args, **kwargs)
    return wrapper


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] (non-negative, any positive total) by inverse CDF.

    One uniform from `generator` per draw. A token of probability 0 is never returned: the
    token taken is the first whose cumulative mass exceeds u * total.
    """
    cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    return min(i, probs.shape[0] - 1)


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator seeded for one request, or None to use torch's default stream."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def apply_penalties(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """logits [V] float32 -> penalized copy (repetition over prompt+output, presence/frequency over output)."""
    p = row.params
    vocab = logits.shape[0]
    out = logits
    if p.repetition_penalty != 1.0 and (row.prompt_ids or row.output_ids):
        seen = torch.tensor(list(row.prompt_ids) + list(row.output_ids), dtype=torch.long)
        seen = seen[(seen >= 0) & (seen < vocab)].unique()
        vals = out[seen]
        out = out.clone()
        out[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
        ids = torch.tensor(list(row.output_ids), dtype=torch.long)
        counts = torch.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab).to(out.dtype)
        out = out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on logits [V]; dropped tokens become -inf."""
    out = logits / p.temperature
    vocab = out.shape[0]
    if 0 < p.top_k < vocab:
        kth = torch.topk(out, p.top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if p.top_p < 1.0:
        out = _top_p(out, p.top_p)
    if p.min_p > 0.0:
        probs = torch.softmax(out, dim=-1)
        out = out.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return out


_TOP_P_CANDIDATES = 1024


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drops a token when the mass of the tokens before it (most likely first) reaches top_p.

    The cut usually falls among the few most likely tokens: sort the best 1024 (topk) and fall
    back to a full sort only when their mass stays below top_p. Ties at the cut keep topk's order.
    """
    probs = torch.softmax(logits, dim=-1)
    k = min(_TOP_P_CANDIDATES, probs.shape[0])
    top, order = torch.topk(probs, k)  # sorted, most likely first
    before = torch.cumsum(top, dim=0) - top  # mass strictly before each candidate
    if k < probs.shape[0] and float(before[-1] + top[-1]) < top_p:
        top, order = torch.sort(probs, descending=True)
        before = torch.cumsum(top, dim=0) - top
    keep = before < top_p
    keep[0] = True  # NOTE: a top_p below float32's smallest value compares as 0
    out = torch.full_like(logits, float("-inf"))
    kept = order[keep]
    out[kept] = logits[kept]
    return out


def apply_constraint(logits: torch.Tensor, raw: torch.Tensor, constraint: Constraint) -> torch.Tensor:
    """logits [V] -> a copy with the tokens the grammar forbids at -inf.

    NOTE: the grammar wins over min_tokens: when it allows only tokens that min_tokens banned
    (e.g. EOS once the JSON is complete), they are drawn from the raw logits instead.
    """
    masked = constraint.mask_logits(logits)
    if float(masked.max()) > float("-inf"):
        return masked
    return constraint.mask_logits(raw)


@single_threaded
def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
    """Pick one token per row.

    Args:
        logits: [B, V] (any float dtype; computed in float32).
        rows: B SampleRow, one per logits row.

    Returns:
        SampleResult with B token ids (and logprobs where asked for).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, V], got {tuple(logits.shape)}")
    logits = logits.float()
    tokens: list[int] = []
    logprobs: list[float | None] = []
    tops: list[list[tuple[int, float]] | None] = []
    for i, row in enumerate(rows):
        p = row.params
        raw = logits[i]
        x = raw
        if len(row.output_ids) < p.min_tokens:
            banned = [t for t in (*row.eos_token_ids, *p.stop_token_ids) if 0 <= t < x.shape[0]]
            if banned:
                x = x.clone()
                x[banned] = float("-inf")
        if row.penalties is not None and needs_penalties(p):
            row.penalties.sync(row.prompt_ids, row.output_ids, x.shape[0])
            x = row.penalties.apply(x, p)
        else:
            x = apply_penalties(x, row)
        if row.constraint is not None:
            x = apply_constraint(x, raw, row.constraint)
        if p.greedy:
            token = int(torch.argmax(x))
        else:
            probs = torch.softmax(filter_logits(x, p), dim=-1)
            token = draw(probs, row.generator)
        tokens.append(token)
        if p.logprobs is None:
            logprobs.append(None)
            tops.append(None)
            continue
        lp = torch.log_softmax(raw, dim=-1)
        logprobs.append(float(lp[token]))
        if p.logprobs > 0:
            vals, ids = torch.topk(lp, p.logprobs)
            tops.append([(int(t), float(v)) for t, v in zip(ids, vals)])
        else:
            tops.append([])
    return SampleResult(tokens, logprobs, tops)
