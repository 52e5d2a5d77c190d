"""One generated sequence: its tokens, how many of them have KV, and its output so far."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kog.loader.tokenizer import IncrementalDetokenizer
from kog.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kog.structured_output.grammar import Constraint


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # queued: no KV yet, or KV kept suspended/swapped (a session, a swap preemption)
    RUNNING = "running"      # resident in the KV cache, scheduled every step
    FINISHED = "finished"    # done; a session's sequence keeps its KV parked (suspended) in the allocator


@dataclass(eq=False)
class Sequence:
    """A sequence to compute: tokens all_ids[num_computed:] still need a forward pass.

    NOTE: the last sampled token has no KV until the next step feeds it, so a decoding
    sequence has exactly one token to compute; more than one means it is (re)prefilling.
    """

    seq_id: int
    request_id: str
    index: int                                  # which of the request's n completions
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None = None
    priority: int = 0                           # lower runs first (vLLM's convention)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0                       # leading tokens whose KV is in the cache
    num_cached_tokens: int = 0                  # prompt tokens served by the prefix cache
    num_prefill_computed: int = 0               # tokens computed by prefill chunks (recomputation visible)
    status: SeqStatus = SeqStatus.WAITING
    text: str = ""                              # output text (a matched stop string cut off)
    num_text_emitted: int = 0                   # characters of text already streamed
    finish_reason: str | None = None            # "stop", "length" or "abort"
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

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

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
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
