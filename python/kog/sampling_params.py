"""SamplingParams: what a request asks of the sampler, validated up front (vLLM's field names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kog.errors import InvalidRequest
from kog.speculation.params import SpeculativeParams
from kog.structured_output.params import StructuredOutputParams
from kog.valid_text import check_text

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Args:
        n: completions per prompt (they share the prompt's KV through copy-on-write forks).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p.
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        min_p: drop tokens less likely than min_p times the most likely one.
        repetition_penalty: > 1 discourages every token already in the prompt or output.
        presence_penalty: subtracted once from each token already generated ([-2, 2]).
        frequency_penalty: subtracted per occurrence of each generated token ([-2, 2]).
        seed: makes sampling reproducible for this request, whatever else is in the batch.
        max_tokens: most tokens to generate (None: up to the context length).
        min_tokens: EOS and stop tokens are masked until this many tokens are generated.
        stop: strings that end the generation (not included in the text unless
            include_stop_str_in_output).
        stop_token_ids: token ids that end the generation (kept in token_ids).
        ignore_eos: keep generating after EOS.
        logprobs: return the log-probability of each sampled token and of this many top
            alternatives (0: the sampled token's only).
        prompt_logprobs: return, for every prompt token after the first, its log-probability
            given the tokens before it and this many top alternatives (vLLM's parameter;
            RequestOutput.prompt_logprobs). The prompt is then computed whole: its KV is not
            taken from the prefix cache.
        skip_special_tokens: leave special tokens out of the text.
        structured: constrain the output to a JSON schema, JSON object, grammar, regex or tool
            calls (kog.structured_output; a dict is taken as StructuredOutputParams' fields). None: free text.
        speculative: draft-and-verify decoding for this request (a dict is taken as
            SpeculativeParams' fields). None: one token per step.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutputParams | None = None
    speculative: SpeculativeParams | None = None

    def __post_init__(self) -> None:
        self.structured = _from_dict(StructuredOutputParams, self.structured, "structured")
        self.speculative = _from_dict(SpeculativeParams, self.speculative, "speculative")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        # NOTE: logits / temperature overflows float32 below about 1e-5 (a NaN would fail the
        # whole batch's step); sampling there is argmax anyway, as in vLLM.
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise InvalidRequest naming the first invalid field."""

        def bad(name: str, why: str) -> None:
            raise InvalidRequest(f"{name} {why}, got {getattr(self, name)!r}")

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "must be a finite number")
            return float(v)

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, "must be an integer")
            return v

        if integer("n") < 1:
            bad("n", "must be >= 1")
        if number("temperature") < 0:
            bad("temperature", "must be >= 0")
        if not 0 < number("top_p") <= 1:
            bad("top_p", "must be in (0, 1]")
        if integer("top_k") < -1:
            bad("top_k", "must be -1, 0 (disabled) or >= 1")
        if not 0 <= number("min_p") <= 1:
            bad("min_p", "must be in [0, 1]")
        if number("repetition_penalty") <= 0:
            bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name) <= 2:
                bad(name, "must be in [-2, 2]")
        if self.seed is not None:
            integer("seed")
        if self.max_tokens is not None and integer("max_tokens") < 1:
            bad("max_tokens", "must be >= 1")
        if integer("min_tokens") < 0:
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop", "must be non-empty strings")
        check_text(self.stop, "stop")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and not 0 <= integer("logprobs") <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= integer("prompt_logprobs") <= MAX_LOGPROBS:
            bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputParams):
                bad("structured", "must be StructuredOutputParams or a dict of its fields")
            self.structured.validate()
        if self.speculative is not None:
            if not isinstance(self.speculative, SpeculativeParams):
                bad("speculative", "must be SpeculativeParams or a dict of its fields")
            self.speculative.validate()


def _from_dict(cls: type, value: object, name: str) -> object:
    """A dict of a params dataclass's fields -> the dataclass; anything else unchanged."""
    if not isinstance(value, dict):
        return value
    unknown = set(value) - set(cls.__dataclass_fields__)
    if unknown:
        raise InvalidRequest(f"{name}: unknown fields {sorted(unknown)}")
    return cls(**value)
