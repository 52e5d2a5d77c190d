"""POST /v1/chat/completions: whole responses and SSE streams, logprobs, tool calls
(the responses are built by kog.server.chat_response)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from kog.server.chat_prompt import active_tools, encode_chat
from kog.server.chat_response import ChatResponseContext, chat_choice, chat_stream, chat_usage
from kog.server.errors import APIError
from kog.server.params import check_context, sampling_params, speculative_params
from kog.server.protocol import ChatCompletionRequest
from kog.server.responses import ChatCompletionResponse
from kog.server.routes.common import ERROR_RESPONSES, STREAM_RESPONSE
from kog.server.serving import SSE_HEADERS, Generation
from kog.server.state import get_state, require_api_key
from kog.server.structured import check_compiles, keep_tool_tags, structured_params, tool_parser

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
    ctx = ChatResponseContext(state, body, rid, len(ids), k, parser)
    if body.stream:
        return StreamingResponse(chat_stream(gen, ctx), media_type="text/event-stream", headers=SSE_HEADERS)
    [out] = await gen.run_to_end(request)
    return ChatCompletionResponse(id=rid, created=ctx.created, model=state.model_name,
                                  choices=[chat_choice(ctx, c) for c in out.outputs], usage=chat_usage(ctx, out))
