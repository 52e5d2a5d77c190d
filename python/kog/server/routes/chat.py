"""POST /v1/chat/completions: whole responses and SSE streams, logprobs, tool calls."""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from kog.engine.outputs import CompletionOutput, RequestOutput
from kog.server.chat_prompt import active_tools, encode_chat
from kog.server.errors import APIError
from kog.server.logprobs import chat_logprobs
from kog.server.params import check_context, sampling_params, speculative_params
from kog.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolCall, ToolCallFunction
from kog.server.responses import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
                                  ChatStreamChoice, DeltaFunction, DeltaToolCall, PromptTokensDetails, SessionUsage,
                                  Usage)
from kog.server.routes.common import ERROR_RESPONSES, STREAM_RESPONSE
from kog.server.serving import SSE_DONE, SSE_HEADERS, Generation, sse, sse_error
from kog.server.state import ServerState, get_state, require_api_key
from kog.server.structured import check_compiles, keep_tool_tags, structured_params, tool_parser
from kog.server.tool_parsers import ParsedToolCall, ToolStreamer, parse_tool_calls

router = APIRouter(tags=["openai"], dependencies=[Depends(require_api_key)])


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={**STREAM_RESPONSE, **ERROR_RESPONSES})
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completions. `response_format`, `tool_choice` "required" / named / "auto"
    constrain decoding (server/structured.py): a bad schema is a 400 before any token."""
    state = get_state(request)
    state.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    all_tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    structured = structured_params(body.response_format, all_tools, body.tool_choice, body.parallel_tool_calls)
    tools = active_tools(body)
    ids = encode_chat(body, state.chat_template, state.tokenizer, tools)
    max_tokens = body.max_completion_tokens or body.max_tokens
    check_context(len(ids), max_tokens, state.max_model_len)
    k = (body.top_logprobs or 0) if body.logprobs else None
    speculative = speculative_params(body, state.config.speculative, state.has_draft_model)
    params = sampling_params(body, max_tokens, k, structured, speculative)
    keep_tool_tags(params, state.tokenizer)
    await check_compiles(state, structured)
    gen = Generation(state)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    await gen.start([ids], params, rid, body.priority)
    parser = tool_parser(state.config.tool_call_parser, structured) if tools is not None else None
    ctx = _Ctx(state, body, rid, len(ids), k, parser)
    if body.stream:
        return StreamingResponse(_stream(gen, ctx), media_type="text/event-stream", headers=SSE_HEADERS)
    [out] = await gen.run_to_end(request)
    return ChatCompletionResponse(id=rid, created=ctx.created, model=state.model_name,
                                  choices=[_choice(ctx, c) for c in out.outputs], usage=_usage(ctx, out))


class _Ctx:
    """What building a response needs besides the engine output."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, rid: str, n_prompt: int, k: int | None,
                 parser: str | None, session: bool = False) -> None:
        self.state, self.body, self.rid, self.n_prompt, self.k = state, body, rid, n_prompt, k
        self.session = session  # usage reports prefill_tokens_computed
        self.parser = parser  # the tool-call parser (tool_parsers.PARSERS); None: the reply is all content
        self.created = int(time.time())


def _choice(ctx: _Ctx, c: CompletionOutput) -> ChatChoice:
    content: str | None = c.text
    calls: list[ParsedToolCall] = []
    if ctx.parser is not None:
        parsed = parse_tool_calls(c.text, ctx.parser)
        content, calls = parsed.content, _limit(parsed.calls, ctx.body) or _named_call(c.text, ctx.body)
        content = None if calls and not parsed.calls else content
    logprobs = chat_logprobs(ctx.state.tokenizer, c.token_ids, c.logprobs or [], ctx.k) if ctx.k is not None else None
    message = AssistantMessage(content=content, tool_calls=[_tool_call(t) for t in calls] or None)
    return ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=_finish(c.finish_reason, calls))


async def _stream(gen: Generation, ctx: _Ctx) -> AsyncIterator[str]:
    n = ctx.body.n
    streamers = {i: ToolStreamer(ctx.parser) for i in range(n)} if ctx.parser else {}
    done: set[int] = set()
    last: RequestOutput | None = None
    try:
        for i in range(n):
            yield sse(_chunk(ctx, [ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""))]))
        async for _, u in gen.updates():
            last = u.output
            outs = {c.index: c for c in u.output.outputs}
            choices = []
            for d in u.deltas:
                text, calls, finish = d.text, [], d.finish_reason
                if d.index in streamers:
                    text = streamers[d.index].feed(text)
                    if finish is not None:
                        rest, calls = streamers[d.index].finish()
                        calls = _limit(calls, ctx.body) or _named_call(streamers[d.index].text, ctx.body)
                        text = text + rest if not calls or rest.strip() else text
                logprobs = None
                if ctx.k is not None:
                    c = outs[d.index]
                    logprobs = chat_logprobs(ctx.state.tokenizer, d.token_ids,
                                             (c.logprobs or [])[-len(d.token_ids):], ctx.k)
                delta = ChatDelta(content=text or None,
                                  tool_calls=[_delta_call(j, t) for j, t in enumerate(calls)] or None)
                if finish is not None:
                    done.add(d.index)
                if delta.content or delta.tool_calls or logprobs or finish:
                    choices.append(ChatStreamChoice(index=d.index, delta=delta, logprobs=logprobs,
                                                    finish_reason=_finish(finish, calls)))
            if u.finished:  # an abort ends choices that got no final delta
                choices += [ChatStreamChoice(index=c.index, delta=ChatDelta(), finish_reason=c.finish_reason or "abort")
                            for c in u.output.outputs if c.index not in done]
            for choice in choices:  # one choice per chunk, as OpenAI streams (clients read choices[0])
                yield sse(_chunk(ctx, [choice]))
        if ctx.body.stream_options is not None and ctx.body.stream_options.include_usage and last is not None:
            yield sse(_chunk(ctx, [], usage=_usage(ctx, last)))
        yield SSE_DONE
    except Exception as e:  # the status line is sent already: report in the stream
        yield sse_error(e)
        yield SSE_DONE
    finally:
        gen.close()


# ---- internal helpers -------------------------------------------------------------------------


def _chunk(ctx: _Ctx, choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=ctx.rid, created=ctx.created, model=ctx.state.model_name, choices=choices,
                               usage=usage)


def _usage(ctx: _Ctx, out: RequestOutput) -> Usage:
    completion = sum(len(c.token_ids) for c in out.outputs)
    fields = dict(prompt_tokens=ctx.n_prompt, completion_tokens=completion, total_tokens=ctx.n_prompt + completion,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))
    if ctx.session:
        return SessionUsage(**fields, prefill_tokens_computed=out.prefill_tokens_computed)
    return Usage(**fields)


def _finish(reason: str | None, calls: list[ParsedToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _limit(calls: list[ParsedToolCall], body: ChatCompletionRequest) -> list[ParsedToolCall]:
    """parallel_tool_calls: false keeps the first call only."""
    return calls if body.parallel_tool_calls else calls[:1]


def _named_call(text: str, body: ChatCompletionRequest) -> list[ParsedToolCall]:
    """With a named tool_choice, a reply that is a bare JSON object is that tool's arguments."""
    if not isinstance(body.tool_choice, NamedToolChoice):
        return []
    try:
        args = json.loads(text)
    except ValueError:
        return []
    if not isinstance(args, dict):
        return []
    return [ParsedToolCall(body.tool_choice.function.name, json.dumps(args, ensure_ascii=False))]


def _tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=ToolCallFunction(name=call.name,
                                                                                   arguments=call.arguments))


def _delta_call(index: int, call: ParsedToolCall) -> DeltaToolCall:
    t = _tool_call(call)
    return DeltaToolCall(index=index, id=t.id, type="function",
                         function=DeltaFunction(name=call.name, arguments=call.arguments))
