"""What the engine returns: vLLM-shaped request outputs, plus Kog's recomputation counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a sequence stopped: the mirror of the native kog._C.FinishReason (same names; NONE,
    "still running", is None here). A str enum: it compares equal to vLLM's strings ("stop")
    and serializes as them."""

    STOP = "stop"      # a stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"    # aborted

    def __str__(self) -> str:
        return self.value

    @classmethod
    def from_native(cls, reason) -> FinishReason | None:
        """The FinishReason of a kog._C.FinishReason (or its integer value); None for NONE."""
        from kog import _C

        native = _C.FinishReason(int(reason))
        return None if native == _C.FinishReason.NONE else cls[native.name]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: {token id: logprob}, sampled token first
    finish_reason: FinishReason | None = None  # STOP, LENGTH, ABORT (== "stop", ...) or None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]         # NOTE: shared by every output of the request: do not modify
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0          # prompt tokens whose KV came from the prefix cache
    prefill_tokens_computed: int = 0    # tokens prefilled for this request, recomputation included
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token, finished (monotonic s)
    num_forward_passes: int = 0         # target-model forwards over this request's sequences (summed)
    # With SamplingParams.prompt_logprobs: per prompt token {token id: logprob}, the prompt's token
    # first, then the top alternatives; None for the first token (nothing predicts it). Filled
    # when the prompt's prefill is done, None until then and without the parameter (vLLM's field).
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class StreamDelta:
    """New output of one sequence after a step (for streaming)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
