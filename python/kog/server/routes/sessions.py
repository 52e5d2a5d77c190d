"""/v1/sessions: agent sessions over HTTP (docs/SESSIONS.md). The conversation's KV stays in
the engine between turns; each generation computes only what was appended since.

Every engine call runs on the AsyncEngine's loop thread (AsyncEngine.call); generations go
through the same request streams as chat completions, so a client that leaves aborts its
generation and the session's context stays as it was.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from kog.conversation import appended_messages
from kog.engine.request_stream import RequestStream
from kog.server.chat_prompt import encode_messages, message_dict
from kog.server.chat_response import ChatResponseContext, chat_choice, chat_stream, chat_usage
from kog.server.errors import APIError
from kog.server.params import check_context, sampling_params, speculative_params
from kog.server.routes.common import ERROR_RESPONSES, STREAM_RESPONSE
from kog.server.serving import SSE_HEADERS, Generation
from kog.server.session_protocol import (SessionAppendRequest, SessionCompletionResponse, SessionDeleted,
                                         SessionForked, SessionForkRequest, SessionGenerateRequest, SessionInfo,
                                         SessionObject, SessionOpenRequest, SessionRollbackRequest, SessionState,
                                         SessionSuspendRequest, SessionTokens)
from kog.server.session_store import ServerSession
from kog.server.state import ServerState, get_state, require_api_key
from kog.server.structured import check_compiles, keep_tool_tags, structured_params, tool_parser
from kog.llm_session import append_render

router = APIRouter(tags=["sessions"], dependencies=[Depends(require_api_key)])
_ERRORS = {**ERROR_RESPONSES, 404: {**ERROR_RESPONSES[404], "description": "Unknown model or session"},
           409: {"model": ERROR_RESPONSES[400]["model"], "description": "The session has a request in flight"}}


@router.post("/v1/sessions", response_model=SessionObject, responses=_ERRORS)
async def open_session(body: SessionOpenRequest, request: Request) -> SessionObject:
    """Opens a session on a prefix (messages + tools, or token ids); returns once its KV is computed."""
    state = get_state(request)
    if body.model is not None:
        state.check_model(body.model)
    if (body.messages is None) == (body.prompt_token_ids is None):
        raise APIError(400, "pass exactly one of messages or prompt_token_ids", param="messages")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    messages = [message_dict(m) for m in body.messages] if body.messages is not None else None
    ids = (encode_messages(messages, state.chat_template, state.tokenizer, tools, True, body.chat_template_kwargs)
           if messages is not None else body.prompt_token_ids)
    check_context(len(ids), None, state.max_model_len, "messages" if messages is not None else "prompt_token_ids")
    sid = f"sess-{uuid.uuid4().hex}"
    stream = await state.engine.open_session(sid, ids, body.pin, body.priority)
    out = await _run_session_request(state, sid, stream, close_on_abort=True)
    state.sessions[sid] = ServerSession(sid, messages, tools, dict(body.chat_template_kwargs or {}), len(ids))
    return SessionObject(id=sid, num_tokens=len(ids), prefill_tokens_computed=out.prefill_tokens_computed,
                         cached_tokens=out.num_cached_tokens)


@router.post("/v1/sessions/{session_id}/generate", response_model=SessionCompletionResponse,
             responses={**STREAM_RESPONSE, **_ERRORS})
async def generate(session_id: str, body: SessionGenerateRequest, request: Request):
    """A chat completion continuing the session; its output joins the context (chat mode: as an
    assistant message). usage.prefill_tokens_computed counts the tokens computed for it.
    `response_format` and `tool_choice` (over the session's tools) constrain decoding."""
    state = get_state(request)
    session = _session(state, session_id)
    if body.model is not None:
        state.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    n_context = await _num_tokens(state, session_id)
    max_tokens = body.max_completion_tokens or body.max_tokens
    check_context(n_context, max_tokens, state.max_model_len)
    k = (body.top_logprobs or 0) if body.logprobs else None
    structured = structured_params(body.response_format, session.tools, body.tool_choice, body.parallel_tool_calls)
    speculative = speculative_params(body, state.config.speculative, state.has_draft_model)
    params = sampling_params(body, max_tokens, k, structured, speculative)
    keep_tool_tags(params, state.tokenizer)
    await check_compiles(state, structured)
    gen = Generation(state)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    await gen.start_session(session_id, params, rid, body.priority, n_context)
    parse = session.tools is not None and body.tool_choice != "none"
    parser = tool_parser(state.config.tool_call_parser, structured) if parse else None
    ctx = ChatResponseContext(state, body, rid, n_context, k, parser, session=True)
    if body.stream:
        return StreamingResponse(_stream_and_record(gen, ctx, session), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    [out] = await gen.run_to_end(request)
    _record_output(session, out, ctx)
    return SessionCompletionResponse(id=rid, created=ctx.created, model=state.model_name,
                                     choices=[chat_choice(ctx, c) for c in out.outputs],
                                     usage=chat_usage(ctx, out))


@router.post("/v1/sessions/{session_id}/append", response_model=SessionTokens, responses=_ERRORS)
async def append(session_id: str, body: SessionAppendRequest, request: Request) -> SessionTokens:
    """Adds messages (chat mode: the new ones, or the whole conversation of which only what
    follows the session's messages is added, 409 `conversation_diverged` when it differs from
    them; the whole conversation is re-rendered and checked) or token ids."""
    state = get_state(request)
    session = _session(state, session_id)
    sessions = state.engine.engine.sessions
    if (body.messages is None) == (body.token_ids is None):
        raise APIError(400, "pass exactly one of messages or token_ids", param="messages")
    if body.token_ids is not None:
        await state.engine.call(sessions.append, session_id, body.token_ids)
        session.leave_chat_mode()
    else:
        if session.messages is None:
            raise APIError(400, "messages can only be appended to a session opened with messages (and no "
                                "token-level append or rollback since)", param="messages")
        new = appended_messages(session.messages, [message_dict(m) for m in body.messages], session.replies)
        conversation = session.messages + new
        full = encode_messages(conversation, state.chat_template, state.tokenizer, session.tools, True,
                               session.chat_kwargs)
        await state.engine.call(append_render, sessions, session_id, full, session.rendered)
        session.messages, session.rendered = conversation, len(full)
    return SessionTokens(num_tokens=await _num_tokens(state, session_id))


@router.post("/v1/sessions/{session_id}/fork", response_model=SessionForked, responses=_ERRORS)
async def fork(session_id: str, body: SessionForkRequest, request: Request) -> SessionForked:
    """n new sessions with this context, sharing its KV copy-on-write (appended tokens are prefilled once first)."""
    state = get_state(request)
    session = _session(state, session_id)
    sessions = state.engine.engine.sessions
    info = await state.engine.call(sessions.info, session_id)
    if info["request_id"] is None and info["num_computed"] < len(info["token_ids"]) - 1:
        stream = await state.engine.add_session_request(session_id, None)
        await _run_session_request(state, session_id, stream, close_on_abort=False)
    ids = [f"sess-{uuid.uuid4().hex}" for _ in range(body.n)]
    await state.engine.call(sessions.fork, session_id, ids)
    for sid in ids:
        state.sessions[sid] = session.fork(sid)
    return SessionForked(ids=ids)


@router.post("/v1/sessions/{session_id}/suspend", response_model=SessionState, responses=_ERRORS)
async def suspend(session_id: str, body: SessionSuspendRequest, request: Request) -> SessionState:
    """The session waits on a tool; offload: true swaps its KV to the host pool now."""
    state = get_state(request)
    _session(state, session_id)
    return SessionState(state=await state.engine.call(state.engine.engine.sessions.suspend, session_id, body.offload))


@router.post("/v1/sessions/{session_id}/rollback", response_model=SessionTokens, responses=_ERRORS)
async def rollback(session_id: str, body: SessionRollbackRequest, request: Request) -> SessionTokens:
    """Keeps the first num_tokens of the context; leaves chat mode."""
    state = get_state(request)
    session = _session(state, session_id)
    await state.engine.call(state.engine.engine.sessions.rollback, session_id, body.num_tokens)
    session.leave_chat_mode()
    session.rendered = min(session.rendered, body.num_tokens)
    return SessionTokens(num_tokens=await _num_tokens(state, session_id))


@router.get("/v1/sessions/{session_id}", response_model=SessionInfo, responses=_ERRORS)
async def get_session(session_id: str, request: Request) -> SessionInfo:
    state = get_state(request)
    session = _session(state, session_id)
    info = await state.engine.call(state.engine.engine.sessions.info, session_id)
    return SessionInfo(id=session_id, num_tokens=len(info["token_ids"]), token_ids=info["token_ids"],
                       num_computed=info["num_computed"],
                       kv_state=str(info["kv_state"]), pinned_tokens=info["pinned_tokens"],
                       busy=info["request_id"] is not None, chat_mode=session.messages is not None,
                       messages=session.messages)


@router.delete("/v1/sessions/{session_id}", response_model=SessionDeleted, responses=_ERRORS)
async def delete_session(session_id: str, request: Request) -> SessionDeleted:
    """Ends the session's request in flight at once (its client gets a 409 `session_closed`
    error, or that error event in its stream), frees its KV, unpins its prefix. Deleting an
    unknown (or already deleted) session is not an error: `deleted` is false."""
    state = get_state(request)
    known = state.sessions.pop(session_id, None) is not None
    if known:
        await state.engine.close_session(session_id)
    return SessionDeleted(id=session_id, deleted=known)


# ---- internal helpers -------------------------------------------------------------------------


def _session(state: ServerState, session_id: str) -> ServerSession:
    session = state.sessions.get(session_id)
    if session is None:
        raise APIError(404, f"No session with id {session_id!r}", param="session_id", code="session_not_found")
    return session


async def _num_tokens(state: ServerState, session_id: str) -> int:
    return len((await state.engine.call(state.engine.engine.sessions.info, session_id))["token_ids"])


async def _run_session_request(state: ServerState, session_id: str, stream: RequestStream, close_on_abort: bool):
    """Waits for a prefill-only request; if the client leaves first it is aborted (and a
    session being opened is closed, since nobody will ever learn its id)."""
    last = None
    try:
        async for u in stream:
            last = u.output
    finally:
        stream.close()
        if close_on_abort and not _completed(last):
            asyncio.ensure_future(_close_quietly(state, session_id))
    return last


def _completed(out) -> bool:
    return out is not None and out.finished and all(c.finish_reason != "abort" for c in out.outputs)


async def _close_quietly(state: ServerState, session_id: str) -> None:
    try:
        await state.engine.close_session(session_id)
    except Exception:  # the engine is stopping: it closes every session itself
        pass


def _record_output(session: ServerSession, out, ctx: ChatResponseContext) -> None:
    """Chat mode: a generation that joined the context becomes an assistant message."""
    # NOTE: recorded as the raw text, which the template renders back as the model wrote it
    # (append_render aligns any re-tokenization difference); the reply as the client got it
    # is kept beside, to recognise it in a whole conversation sent back to append.
    if session.messages is not None and _completed(out):
        session.replies[len(session.messages)] = chat_choice(ctx, out.outputs[0]).message.model_dump(exclude_none=True)
        session.messages.append({"role": "assistant", "content": out.outputs[0].text})


async def _stream_and_record(gen: Generation, ctx: ChatResponseContext, session: ServerSession):
    """The chat SSE stream; the output is recorded even when the client leaves after its end."""
    try:
        async for chunk in chat_stream(gen, ctx):
            yield chunk
    finally:
        out = gen.last.get(0)
        if out is not None:
            _record_output(session, out, ctx)
