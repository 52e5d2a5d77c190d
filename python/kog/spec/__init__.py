"""Structured output and speculative decoding.

    params.py       StructuredOutputParams, SpeculativeParams (carried by SamplingParams)
    formats.py      params -> an llguidance Lark grammar (JSON schema, tool calls, regex)
    grammar.py      Constraint: per-sequence masks, advance, jump-forward, rollback, fork
    ngram.py        prompt-lookup drafter
    draft_model.py  small-model drafter over its own paged KV cache
    verify.py       greedy verification and speculative rejection sampling

Only params is imported here, so `kog.sampling_params` does not pull in llguidance or torch.
See docs/STRUCTURED.md.
"""

from kog.spec.params import SpeculativeParams, StructuredOutputParams

__all__ = ["SpeculativeParams", "StructuredOutputParams"]
