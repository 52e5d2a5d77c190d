"""POST /v1/completions: text completions of one or several prompts (text or token ids)."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from kog.engine.outputs import CompletionOutput, RequestOutput
from kog.server.errors import APIError
from kog.server.logprobs import completion_logprobs
from kog.server.params import check_context, sampling_params, speculative_params
from kog.server.protocol import CompletionRequest
from kog.server.responses import CompletionChoice, CompletionResponse, PromptTokensDetails, Usage
from kog.server.routes.common import ERROR_RESPONSES, STREAM_RESPONSE
from kog.server.serving import SSE_DONE, SSE_HEADERS, Generation, sse, sse_error
from kog.server.state import ServerState, get_state, require_api_key
from kog.server.structured import check_compiles, structured_params

router = APIRouter(tags=["openai"], dependencies=[Depends(require_api_key)])


@router.post("/v1/completions", response_model=CompletionResponse, responses={**STREAM_RESPONSE, **ERROR_RESPONSES})
async def create_completion(body: CompletionRequest, request: Request):
    """OpenAI text completions. Choice i * n + j is completion j of prompt i; `response_format`
    constrains every choice's text."""
    state = get_state(request)
    state.check_model(body.model)
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", param="echo")
    texts, prompts = _prompts(body, state)
    for ids in prompts:
        check_context(len(ids), body.max_tokens, state.max_model_len, "prompt")
    structured = structured_params(body.response_format, None, None, True)
    speculative = speculative_params(body, state.config.speculative, state.has_draft_model)
    params = sampling_params(body, body.max_tokens, body.logprobs, structured, speculative)
    await check_compiles(state, structured)
    gen = Generation(state)
    ctx = _Ctx(state, body, f"cmpl-{uuid.uuid4().hex}", texts, prompts)
    await gen.start(prompts, params, ctx.rid, body.priority, texts)
    if body.stream:
        return StreamingResponse(_stream(gen, ctx), media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await gen.run_to_end(request)
    choices = [_choice(ctx, i, c) for i, out in enumerate(outs) for c in out.outputs]
    return CompletionResponse(id=ctx.rid, created=ctx.created, model=state.model_name, choices=choices,
                              usage=_usage(prompts, outs))


class _Ctx:
    def __init__(self, state: ServerState, body: CompletionRequest, rid: str, texts: list[str | None],
                 prompts: list[list[int]]) -> None:
        self.state, self.body, self.rid, self.texts, self.prompts = state, body, rid, texts, prompts
        self.created = int(time.time())

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


def _choice(ctx: _Ctx, i: int, c: CompletionOutput) -> CompletionChoice:
    logprobs = None
    if ctx.body.logprobs is not None:
        logprobs = completion_logprobs(ctx.state.tokenizer, c.token_ids, c.logprobs or [], ctx.body.logprobs)
    return CompletionChoice(index=i * ctx.body.n + c.index, text=ctx.echo(i) + c.text, logprobs=logprobs,
                            finish_reason=c.finish_reason)


def _usage(prompts: list[list[int]], outs: list[RequestOutput]) -> Usage:
    n_prompt = sum(len(p) for p in prompts)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _stream(gen: Generation, ctx: _Ctx) -> AsyncIterator[str]:
    n = ctx.body.n
    last: dict[int, RequestOutput] = {}
    offsets: dict[int, int] = {}  # choice index -> characters of text sent (for text_offset)
    done: set[int] = set()
    try:
        if ctx.body.echo:
            for i in range(len(ctx.prompts)):
                for j in range(n):
                    yield sse(_chunk(ctx, [CompletionChoice(index=i * n + j, text=ctx.echo(i))]))
        async for i, u in gen.updates():
            last[i] = u.output
            outs = {c.index: c for c in u.output.outputs}
            choices = []
            for d in u.deltas:
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
                    choices.append(CompletionChoice(index=index, text=d.text, logprobs=logprobs,
                                                    finish_reason=d.finish_reason))
            if u.finished:
                choices += [CompletionChoice(index=i * n + c.index, text="", finish_reason=c.finish_reason or "abort")
                            for c in u.output.outputs if i * n + c.index not in done]
            for choice in choices:  # one choice per chunk, as OpenAI streams (clients read choices[0])
                yield sse(_chunk(ctx, [choice]))
        if ctx.body.stream_options is not None and ctx.body.stream_options.include_usage:
            yield sse(_chunk(ctx, [], usage=_usage(ctx.prompts, [last[i] for i in sorted(last)])))
        yield SSE_DONE
    except Exception as e:
        yield sse_error(e)
        yield SSE_DONE
    finally:
        gen.close()


def _chunk(ctx: _Ctx, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
    return CompletionResponse(id=ctx.rid, created=ctx.created, model=ctx.state.model_name, choices=choices,
                              usage=usage)
