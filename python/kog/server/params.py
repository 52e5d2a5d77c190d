"""From an OpenAI request to the engine's SamplingParams, and the context-length check."""

from __future__ import annotations

import dataclasses

from kog.errors import InvalidRequest
from kog.server.errors import APIError
from kog.server.protocol import SamplingFields
from kog.sampling_params import SamplingParams
from kog.speculation.params import SpeculativeParams
from kog.structured_output.params import StructuredOutputParams

_SEED_RANGE = 2**63 - 64  # torch seeds are 64-bit; n > 1 adds the choice index to the seed


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutputParams | None = None,
                    speculative: SpeculativeParams | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters for a request.

    Args:
        req: the validated body (chat or text completion).
        max_tokens: the completion budget already resolved (None: up to the context length).
        logprobs: top alternatives per token to return (None: no logprobs).
        structured: the output constraint (server/structured.py), None for free output.
        speculative: the request's speculative decoding (speculative_params).
        prompt_logprobs: top alternatives per prompt token to compute (None: none).
    Raises:
        InvalidRequest: a combination the engine refuses (e.g. min_tokens > max_tokens), naming the field.
    """
    fields: dict = dict(n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                        stop=req.stop, stop_token_ids=req.stop_token_ids or [], logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                        skip_special_tokens=req.skip_special_tokens,
                        include_stop_str_in_output=req.include_stop_str_in_output,
                        seed=None if req.seed is None else req.seed % _SEED_RANGE,
                        structured=structured, speculative=speculative)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    return SamplingParams(**fields)


def speculative_params(req: SamplingFields, default: SpeculativeParams | None,
                       has_draft_model: bool) -> SpeculativeParams | None:
    """The request's `speculative` field, or the server's default when the field is absent
    (`"speculative": null` turns it off).

    Raises:
        APIError: 400 for values SpeculativeParams refuses, or method "draft" without a draft model.
    """
    if "speculative" not in req.model_fields_set:
        spec = None if default is None else dataclasses.replace(default)
    elif req.speculative is None:
        return None
    else:
        try:
            spec = SpeculativeParams(**req.speculative.model_dump())
        except InvalidRequest as e:
            raise APIError(400, str(e), param="speculative") from None
    if spec is not None and spec.method == "draft" and not has_draft_model:
        raise APIError(400, "speculative.method 'draft' needs a draft model (kog serve --speculative-model PATH)",
                       param="speculative")
    return spec


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                  prompt_field: str = "messages") -> None:
    """400 context_length_exceeded unless the prompt, plus max_tokens (or one token), fits.

    Args:
        prompt_field: the request field to blame when max_tokens is unset ("messages", "prompt").

    Raises:
        APIError: the OpenAI-shaped error, with the numbers.
    """
    wanted = num_prompt_tokens + (max_tokens or 1)
    if wanted > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{wanted} tokens ({num_prompt_tokens} in the prompt, {max_tokens or 1} for the "
                            f"completion). Please reduce the prompt or max_tokens.",
                       param=prompt_field if max_tokens is None else "max_tokens", code="context_length_exceeded")


def default_max_tokens(num_prompt_tokens: int, max_model_len: int) -> int:
    """The budget of a request that sets none: what is left of the context."""
    return max(1, max_model_len - num_prompt_tokens)
