"""Structured output: constraining what a model may write (JSON schema, tool calls, Lark grammar,
regex).

    params.py        StructuredOutputParams (carried by SamplingParams)
    formats.py       params -> an llguidance Lark grammar (JSON schema, tool calls, regex)
    grammar.py       Constraint: per-sequence masks, advance, jump-forward, rollback, fork
    lark_check.py    can a Lark grammar ever finish
    unique_items.py  uniqueItems over enum/const items, enforced by a bounded rewrite
    call_budget.py   finishing a constrained tool call within max_tokens

Only params is imported here, so `kog.sampling_params` does not pull in llguidance or torch.
See docs/STRUCTURED.md.
"""

from kog.structured_output.params import StructuredOutputParams

__all__ = ["StructuredOutputParams"]
