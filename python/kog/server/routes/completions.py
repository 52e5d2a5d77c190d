"""POST /v1/completions: text completions of one or several prompts (text or token ids)."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from kog.engine.async_engine import RequestUpdate
from kog.engine.outputs import CompletionOutput, RequestOutput
from kog.server.errors import APIError
from kog.server.logprobs import completion_logprobs, prompt_logprobs
from kog.server.params import check_context, sampling_params, speculative_params
from kog.server.protocol import CompletionRequest
from kog.server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, PromptTokensDetails, Usage
from kog.server.routes.common import ERROR_RESPONSES, STREAM_RESPONSE
from kog.server.serving import SSE_DONE, SSE_HEADERS, Generation, sse, sse_error
from kog.server.state import ServerState, get_state, require_api_key
from kog.server.structured import check_compiles, structured_params

router = APIRouter(tags=["openai"], dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", response_model=CompletionResponse, responses={**STREAM_RESPONSE, **ERROR_RESPONSES})
async def create_completion(body: CompletionRequest, request: Request):
    """OpenAI text completions. Choice i * n + j is completion j of prompt i; `response_format`
    constrains every choice's text. `echo` puts the prompt before the text (with `logprobs`, its
    tokens' logprobs before the completion's; with `max_tokens` 0, the prompt alone)."""
    state = get_state(request)
    state.check_model(body.model)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 returns the prompt alone: it needs echo", param="max_tokens")
    texts, prompts = _prompts(body, state)
    for ids in prompts:
        check_context(len(ids), body.max_tokens, state.max_model_len, "prompt")
    structured = structured_params(body.response_format, None, None, True)
    speculative = speculative_params(body, state.config.speculative, state.has_draft_model)
    # NOTE: an echo of the prompt alone still samples one token (the engine always does), never shown.
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    params = sampling_params(body, max_tokens, body.logprobs, structured, speculative, _prompt_logprobs_wanted(body))
    await check_compiles(state, structured)
    gen = Generation(state)
    ctx = _Ctx(state, body, f"cmpl-{uuid.uuid4().hex}", texts, prompts)
    await gen.start(prompts, params, ctx.rid, body.priority, texts)
    if body.stream:
        return StreamingResponse(_stream(gen, ctx), media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await gen.run_to_end(request)
    choices = [_choice(ctx, i, out, c) for i, out in enumerate(outs) for c in out.outputs]
    return CompletionResponse(id=ctx.rid, created=ctx.created, model=state.model_name, choices=choices,
                              usage=_usage(ctx, outs))


class _Ctx:
    def __init__(self, state: ServerState, body: CompletionRequest, rid: str, texts: list[str | None],
                 prompts: list[list[int]]) -> None:
        self.state, self.body, self.rid, self.texts, self.prompts = state, body, rid, texts, prompts
        self.created = int(time.time())
        self.echo_only = body.echo and body.max_tokens == 0  # the sampled token is dropped
        self.wants_prompt_logprobs = _prompt_logprobs_wanted(body) is not None

    def echo(self, i: int) -> str:
        if not self.body.echo:
            return ""
        return self.texts[i] if self.texts[i] is not None else self.state.tokenizer.decode(self.prompts[i])


def _prompts(body: CompletionRequest, state: ServerState) -> tuple[list[str | None], list[list[int]]]:
    """(texts, token ids) of each prompt: a string, strings, token ids, or lists of token ids."""
    p = body.prompt
    if isinstance(p, str):
        p = [p]
    if not p or any(isinstance(x, (str, list)) and len(x) == 0 for x in p):
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, str) for x in p):
        return list(p), [state.tokenizer.encode(x) for x in p]
    if all(isinstance(x, int) for x in p):
        return [None], [list(p)]
    return [None] * len(p), [list(x) for x in p]


def _prompt_logprobs_wanted(body: CompletionRequest) -> int | None:
    """Top alternatives per prompt token the engine computes: `prompt_logprobs`', and
    `logprobs`' when the prompt is echoed (None: no prompt logprobs)."""
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return max(wanted) if wanted else None


def _prompt_choice(ctx: _Ctx, i: int, out: RequestOutput | None) -> CompletionChoice:
    """The part of prompt i's choices that comes from the prompt: the echo, its tokens'
    logprobs (echo + logprobs) and `prompt_logprobs`. `out` is needed for the last two."""
    body, tokenizer, logprobs, prompt_lps = ctx.body, ctx.state.tokenizer, None, None
    entries = (out.prompt_logprobs if out is not None else None) or []
    if body.echo and body.logprobs is not None:
        logprobs = completion_logprobs(tokenizer, ctx.prompts[i], entries, body.logprobs)
    if body.prompt_logprobs is not None:
        prompt_lps = prompt_logprobs(tokenizer, ctx.prompts[i], entries, body.prompt_logprobs)
    return CompletionChoice(index=0, text=ctx.echo(i), logprobs=logprobs, prompt_logprobs=prompt_lps)


def _choice(ctx: _Ctx, i: int, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
    choice = _prompt_choice(ctx, i, out)
    choice.index = i * ctx.body.n + c.index
    if ctx.echo_only:
        choice.finish_reason = "length" if c.finish_reason != "abort" else "abort"
        return choice
    if ctx.body.logprobs is not None:
        generated = completion_logprobs(ctx.state.tokenizer, c.token_ids, c.logprobs or [], ctx.body.logprobs,
                                        len(choice.text))
        choice.logprobs = generated if choice.logprobs is None else _concat(choice.logprobs, generated)
    choice.text += c.text
    choice.finish_reason = c.finish_reason
    return choice


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def _usage(ctx: _Ctx, outs: list[RequestOutput]) -> Usage:
    n_prompt = sum(len(p) for p in ctx.prompts)
    n_out = 0 if ctx.echo_only else sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _stream(gen: Generation, ctx: _Ctx) -> AsyncIterator[str]:
    last: dict[int, RequestOutput] = {}
    offsets: dict[int, int] = {}  # choice index -> characters of text sent (for text_offset)
    done: set[int] = set()
    # NOTE: a choice's first chunk carries the prompt's part (_prompt_choice): at once for a plain
    # echo; with prompt logprobs, with the prompt's first update (its prefill has computed them).
    pending = set(range(len(ctx.prompts))) if ctx.body.echo or ctx.wants_prompt_logprobs else set()
    try:
        if not ctx.wants_prompt_logprobs:
            for i in sorted(pending):
                for choice in _prompt_choices(ctx, i, None, offsets):
                    yield sse(_chunk(ctx, [choice]))
            pending.clear()
        async for i, u in gen.updates():
            last[i] = u.output
            choices = []
            if i in pending and u.output.prompt_logprobs is not None:
                pending.discard(i)
                choices += _prompt_choices(ctx, i, u.output, offsets)
            choices += _delta_choices(ctx, i, u, offsets, done)
            for choice in choices:  # one choice per chunk, as OpenAI streams (clients read choices[0])
                yield sse(_chunk(ctx, [choice]))
        if ctx.body.stream_options is not None and ctx.body.stream_options.include_usage:
            yield sse(_chunk(ctx, [], usage=_usage(ctx, [last[i] for i in sorted(last)])))
        yield SSE_DONE
    except Exception as e:
        yield sse_error(e)
        yield SSE_DONE
    finally:
        gen.close()


def _prompt_choices(ctx: _Ctx, i: int, out: RequestOutput | None, offsets: dict[int, int]) -> list[CompletionChoice]:
    """The first chunk of each of prompt i's n choices."""
    head = _prompt_choice(ctx, i, out)
    choices = [head.model_copy(update={"index": i * ctx.body.n + j}) for j in range(ctx.body.n)]
    for choice in choices:
        offsets[choice.index] = len(head.text)
    return choices


def _delta_choices(ctx: _Ctx, i: int, u: RequestUpdate, offsets: dict[int, int],
                   done: set[int]) -> list[CompletionChoice]:
    """The chunks of an update of prompt i: new text (with its logprobs), then the choices it ends."""
    n, choices = ctx.body.n, []
    outs = {c.index: c for c in u.output.outputs}
    for d in [] if ctx.echo_only else u.deltas:
        index = i * n + d.index
        logprobs = None
        if ctx.body.logprobs is not None:
            entries = (outs[d.index].logprobs or [])[-len(d.token_ids):]
            logprobs = completion_logprobs(ctx.state.tokenizer, d.token_ids, entries, ctx.body.logprobs,
                                           offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(d.text)
        if d.finish_reason is not None:
            done.add(index)
        if d.text or logprobs or d.finish_reason:
            choices.append(CompletionChoice(index=index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason))
    if u.finished:
        for c in u.output.outputs:
            reason = c.finish_reason or "abort"
            if ctx.echo_only and reason != "abort":
                reason = "length"  # of the prompt: the sampled token is not shown
            if i * n + c.index not in done:
                choices.append(CompletionChoice(index=i * n + c.index, text="", finish_reason=reason))
    return choices


def _chunk(ctx: _Ctx, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
    return CompletionResponse(id=ctx.rid, created=ctx.created, model=ctx.state.model_name, choices=choices,
                              usage=usage)
