"""/v1/sessions request and response bodies (Kog's agent-session API, docs/SESSIONS.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from kog.server.protocol import (MAX_TOP_LOGPROBS, BodyModel, ChatMessage, RequestBody, ResponseFormat, SamplingFields,
                                 Tool, ToolChoice)
from kog.server.responses import ChatCompletionResponse, SessionUsage


class SessionOpenRequest(RequestBody):
    """Exactly one of messages (chat mode) or prompt_token_ids."""

    model: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    prompt_token_ids: list[int] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    pin: bool = True
    priority: int = 0
    chat_template_kwargs: dict[str, Any] | None = None


class SessionGenerateRequest(SamplingFields):
    """A chat completion on the session's context: no messages (append them first), n is 1
    (fork for branches); tool calls are parsed (and tool_choice constrains them) when the session
    was opened with tools."""

    model: str | None = None
    n: Literal[1] = 1
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


class SessionAppendRequest(RequestBody):
    """Exactly one of messages (chat mode) or token_ids."""

    messages: list[ChatMessage] | None = Field(None, min_length=1)
    token_ids: list[int] | None = Field(None, min_length=1)


class SessionForkRequest(BodyModel):
    n: int = Field(1, ge=1, le=64)


class SessionSuspendRequest(BodyModel):
    offload: bool = False


class SessionRollbackRequest(BodyModel):
    num_tokens: int = Field(ge=1)


class SessionObject(BaseModel):
    id: str
    object: Literal["session"] = "session"
    num_tokens: int                 # the context's length
    prefill_tokens_computed: int    # tokens computed by the opening prefill
    cached_tokens: int              # prefix tokens found in the prefix cache


class SessionInfo(BaseModel):
    id: str
    object: Literal["session"] = "session"
    num_tokens: int
    token_ids: list[int]            # the context
    num_computed: int               # tokens with KV (the last one is always pending)
    kv_state: str
    pinned_tokens: int
    busy: bool                      # a request is in flight
    chat_mode: bool                 # messages can be appended
    messages: list[dict[str, Any]] | None = None


class SessionTokens(BaseModel):
    num_tokens: int


class SessionForked(BaseModel):
    ids: list[str]


class SessionState(BaseModel):
    state: Literal["suspended", "swapped", "dropped"]


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session"] = "session"
    deleted: bool = True


class SessionCompletionResponse(ChatCompletionResponse):
    usage: SessionUsage
