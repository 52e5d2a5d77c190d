"""Per-request settings for speculative decoding (off by default): a plain dataclass with no
model import, so `SamplingParams` can carry it and validate its shape up front."""

from __future__ import annotations

from dataclasses import dataclass

from kog.errors import InvalidRequest

SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeParams:
    """Speculative decoding for one request: draft k tokens, verify them in one target forward.

    Greedy requests get exactly the tokens plain decoding would give; sampled ones get the same
    distribution (rejection sampling). Repetition/presence/frequency penalties are not applied to
    draft positions, so the engine does not speculate for requests that set them.

    Args:
        method: "ngram" (prompt lookup: continue the latest earlier occurrence of the last n-gram)
            or "draft" (the engine's small draft model).
        num_tokens: draft tokens per step (k), 1..16.
        ngram_max, ngram_min: n-gram sizes tried, longest first ("ngram" only).
    """

    method: str = "ngram"
    num_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequest naming the first invalid field."""
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequest(f"speculative.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_tokens", "ngram_max", "ngram_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequest(f"speculative.{name} must be an integer >= 1, got {v!r}")
        if self.num_tokens > MAX_SPECULATIVE_TOKENS:
            raise InvalidRequest(f"speculative.num_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got {self.num_tokens}")
        if self.ngram_min > self.ngram_max:
            raise InvalidRequest(f"speculative.ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
