"""One generated sequence: its tokens, how many of them have KV, and its output so far."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, overload

import torch

from kog.engine.outputs import FinishReason
from kog.loader.tokenizer import IncrementalDetokenizer
from kog.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kog.sampler import PenaltyCounts
    from kog.structured_output.grammar import Constraint


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # queued: no KV yet, or KV kept suspended/swapped (a session, a swap preemption)
    RUNNING = "running"      # resident in the KV cache, scheduled every step
    FINISHED = "finished"    # done; a session's sequence keeps its KV parked (suspended) in the allocator


class TokenSpan(SequenceABC):
    """A read-only view of token_ids[start:stop] of a sequence's token list (stop None: to
    the end, growing with it). O(1) to make; slicing it returns a list.

    NOTE: valid because a Sequence's token list only grows (tokens are appended, never
    changed or removed), so a view never sees different tokens than when it was taken.
    """

    __slots__ = ("_ids", "_start", "_stop")

    def __init__(self, ids: list[int], start: int, stop: int | None = None) -> None:
        self._ids, self._start, self._stop = ids, start, stop

    def __len__(self) -> int:
        return (len(self._ids) if self._stop is None else self._stop) - self._start

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i):
        n = len(self)
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            return self._ids[self._start + a : self._start + b : step] if step > 0 else list(self)[i]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token index out of range")
        return self._ids[self._start + i]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._start, self._start + len(self))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, TokenSpan)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(eq=False)
class Sequence:
    """A sequence to compute: tokens token_ids[num_computed:] still need a forward pass.

    token_ids is the sequence's one token list: the prompt (its first num_prompt_tokens), then
    every output token, appended in place (append_token). prompt_ids and output_ids are O(1)
    views of it.

    NOTE: the last sampled token has no KV until the next step feeds it, so a decoding
    sequence has exactly one token to compute; more than one means it is (re)prefilling.
    """

    seq_id: int
    request_id: str
    index: int                                  # which of the request's n completions
    token_ids: list[int]                        # the prompt at construction; outputs appended
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None = None
    priority: int = 0                           # lower runs first (vLLM's convention)
    num_prompt_tokens: int = -1                 # -1: all of token_ids at construction
    num_computed: int = 0                       # leading tokens whose KV is in the cache
    num_cached_tokens: int = 0                  # prompt tokens served by the prefix cache
    num_prefill_computed: int = 0               # tokens computed by prefill chunks (recomputation visible)
    status: SeqStatus = SeqStatus.WAITING
    text: str = ""                              # output text (a matched stop string cut off)
    num_text_emitted: int = 0                   # characters of text already streamed
    finish_reason: FinishReason | None = None   # STOP, LENGTH or ABORT (a str enum: == "stop")
    stop_reason: int | str | None = None        # the stop token id or stop string that matched
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # NOTE: with params.prompt_logprobs, entry p is prompt token p's (entry 0 is None); they are
    # recorded in position order as prefill chunks compute them, each exactly once.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    session_id: str | None = None               # set: the KV outlives the request (agent session)
    prefill_only: bool = False                  # a session's opening prefix: KV of all but the last token
    # ---- structured output and speculation (kog.engine.structured, kog.engine.speculative)
    constraint: Constraint | None = None        # grammar state; has consumed exactly output_ids
    num_forward_passes: int = 0                 # target-model forwards that computed this sequence's tokens
    penalties: PenaltyCounts | None = None      # repetition/presence/frequency counts, kept up to date by the sampler

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)

    @property
    def prompt_ids(self) -> TokenSpan:
        return TokenSpan(self.token_ids, 0, self.num_prompt_tokens)

    @property
    def output_ids(self) -> TokenSpan:
        """The output tokens so far (a live view: it grows with the sequence)."""
        return TokenSpan(self.token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def num_to_prefill(self) -> int:
        """Tokens still to compute before this sequence is done prefilling.

        NOTE: a prefill-only sequence leaves its last token pending, like a decoding sequence
        whose sampled token has no KV yet: the next generation feeds it and gets its logits.
        """
        return self.num_to_compute - (1 if self.prefill_only else 0)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt positions still lack the logprobs the request asked for (its prefill must
        compute them: none may come from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
