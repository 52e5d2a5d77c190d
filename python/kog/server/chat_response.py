"""Chat completion responses from engine outputs: whole (chat_choice, chat_usage) and streamed as
SSE chunks (chat_stream), with logprobs and tool calls parsed from the text. Shared by
/v1/chat/completions and /v1/sessions/{id}/generate."""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from kog.engine.outputs import CompletionOutput, RequestOutput
from kog.server.logprobs import chat_logprobs
from kog.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolCall, ToolCallFunction
from kog.server.responses import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatDelta, ChatStreamChoice,
                                  DeltaFunction, DeltaToolCall, PromptTokensDetails, SessionUsage, Usage)
from kog.server.serving import SSE_DONE, Generation, sse, sse_error
from kog.server.state import ServerState
from kog.server.tool_parsers import ParsedToolCall, ToolStreamer, parse_tool_calls


# ---- public API -------------------------------------------------------------------------------
class ChatResponseContext:
    """What building a response needs besides the engine output.

    Args:
        state: the server (tokenizer, model name).
        body: the request (n, logprobs, stream_options, tool_choice, parallel_tool_calls).
        rid: the response id.
        n_prompt: prompt tokens (a session's: its whole context) for usage.
        k: top logprobs per token, or None for no logprobs.
        parser: the tool-call parser's name (tool_parsers.PARSERS); None: the reply is all content.
        session: usage reports prefill_tokens_computed (SessionUsage).
    """

    def __init__(self, state: ServerState, body: ChatCompletionRequest, rid: str, n_prompt: int, k: int | None,
                 parser: str | None, session: bool = False) -> None:
        self.state, self.body, self.rid, self.n_prompt, self.k = state, body, rid, n_prompt, k
        self.session = session
        self.parser = parser
        self.created = int(time.time())


def chat_choice(ctx: ChatResponseContext, c: CompletionOutput) -> ChatChoice:
    """One finished completion as a chat choice: content, tool calls parsed out of it, logprobs."""
    content: str | None = c.text
    calls: list[ParsedToolCall] = []
    if ctx.parser is not None:
        parsed = parse_tool_calls(c.text, ctx.parser)
        content, calls = parsed.content, _limit(parsed.calls, ctx.body) or _named_call(c.text, ctx.body)
        content = None if calls and not parsed.calls else content
    logprobs = chat_logprobs(ctx.state.tokenizer, c.token_ids, c.logprobs or [], ctx.k) if ctx.k is not None else None
    message = AssistantMessage(content=content, tool_calls=[_tool_call(t) for t in calls] or None)
    return ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=_finish(c.finish_reason, calls))


async def chat_stream(gen: Generation, ctx: ChatResponseContext) -> AsyncIterator[str]:
    """The SSE events of a generation: a role chunk per choice, one chunk per choice delta (tool
    calls once a choice ends), the usage chunk if asked, [DONE]. An error after the status line
    was sent becomes an error event. Closes gen when done or abandoned."""
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
            yield sse(_chunk(ctx, [], usage=chat_usage(ctx, last)))
        yield SSE_DONE
    except Exception as e:  # the status line is sent already: report in the stream
        yield sse_error(e)
        yield SSE_DONE
    finally:
        gen.close()


def chat_usage(ctx: ChatResponseContext, out: RequestOutput) -> Usage:
    """The usage of a request's output (a session's also counts prefill_tokens_computed)."""
    completion = sum(len(c.token_ids) for c in out.outputs)
    fields = dict(prompt_tokens=ctx.n_prompt, completion_tokens=completion, total_tokens=ctx.n_prompt + completion,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))
    if ctx.session:
        return SessionUsage(**fields, prefill_tokens_computed=out.prefill_tokens_computed)
    return Usage(**fields)


# ---- internal helpers -------------------------------------------------------------------------
def _chunk(ctx: ChatResponseContext, choices: list[ChatStreamChoice],
           usage: Usage | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=ctx.rid, created=ctx.created, model=ctx.state.model_name, choices=choices,
                               usage=usage)


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
