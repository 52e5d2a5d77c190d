"""Helpers for structured-output tests: the default model's tokenizer alone, random JSON schemas
of the kinds agents send, and a synthetic constrained sampling loop (random logits, the real
sampler, optional jump-forward)."""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

import torch

from kog.loader.tokenizer import Tokenizer, tokenizer_from_gguf
from kog.sampler import SampleRow, sample
from kog.sampling_params import SamplingParams
from kog.structured_output.grammar import Constraint

# A small object schema with a bounded string, a bounded integer, an enum and an array.
PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"enum": ["Paris", "London", "Tokyo"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
PATTERNS = [r"^[a-z]{2,6}$", r"^[A-Z][a-z]{1,4}-[0-9]{2}$", r"^(red|green|blue)$", r"^\d{3}-\d{4}$",
            r"^[a-f0-9]{4,8}$", r"^(\+|-)?[0-9]{1,3}(\.[0-9]{1,2})?$", r"^v[0-9]\.[0-9]{1,2}$"]
WORDS = ["alpha", "beta", "gamma", "delta", "Paris", "naïve", "東京", "a b", "x\"y"]


@lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    """SmolLM2-135M-Instruct's tokenizer, read from the default GGUF's metadata (no weights)."""
    from kog.loader.gguf import GGUFCheckpoint
    from kog.loader.hub import default_model_path

    return tokenizer_from_gguf(GGUFCheckpoint(default_model_path()).metadata, source="default model")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random JSON schema: objects (required and optional keys), nested arrays, enums, numbers
    with bounds, strings with patterns or lengths, booleans, null. Every value is bounded in size
    (additionalProperties false, maxItems, maxLength) so random sampling ends.

    Args:
        rng: the source of randomness (seed it).
        depth: nesting depth so far; containers stop at 3.
    """
    kinds = ["integer", "number", "pattern", "string", "enum", "boolean", "null"]
    kinds += ["object", "array"] * (2 if depth < 3 else 0)
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["id", "name", "city", "tags", "score", "ok", "items", "meta", "unit", "when"],
                           rng.randint(1, 4))
        return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": [n for n in names if rng.random() < 0.6], "additionalProperties": False}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        s: dict[str, Any] = {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([0, 1, 9, 500, 100000])}
        if rng.random() < 0.3 and s["maximum"] > lo + 1:
            s["exclusiveMinimum"] = s.pop("minimum")
        return s
    if kind == "number":
        lo = round(rng.uniform(-100, 100), 2)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([0.5, 10, 1000])}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS + [1, 2.5, None, True], rng.randint(1, 4))}
    return {"type": kind}


def sample_constrained(constraint: Constraint, stop_ids: set[int], gen: torch.Generator, max_tokens: int = 400,
                       jump_forward: bool = False, bias: torch.Tensor | None = None) -> tuple[list[int], bool]:
    """Samples at temperature 1.0 from random logits through `kog.sampler.sample` with the
    constraint on the row, until a stop token or max_tokens.

    Args:
        constraint: the sequence's grammar state (advanced in place).
        stop_ids: ids that end the output (the ones the constraint's tokenizer treats as EOS).
        gen: generator for the logits and the draws.
        max_tokens: budget.
        jump_forward: append the grammar's forced tokens without sampling whenever there are some.
        bias: optional [V] added to the random logits.

    Returns:
        (output ids without the stop token, whether a stop token ended it).
    """
    out: list[int] = []
    params = SamplingParams(temperature=1.0, max_tokens=None)
    while len(out) < max_tokens:
        forced = constraint.forced_tokens() if jump_forward else []
        if forced:
            constraint.advance_many(forced)
            out += forced
            continue
        logits = 3.0 * torch.randn(1, constraint.vocab_size, generator=gen)
        if bias is not None:
            logits += bias
        token = sample(logits, [SampleRow(params, [], out, (), gen, constraint)]).token_ids[0]
        constraint.advance(token)
        if token in stop_ids:
            return out, True
        out.append(token)
    return out, False
