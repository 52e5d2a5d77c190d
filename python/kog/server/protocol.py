"""OpenAI request bodies, validated by pydantic (field names and ranges as OpenAI's, a few of
vLLM's extensions: top_k, min_p, repetition_penalty, min_tokens, ignore_eos, priority, ...) and
Kog's `speculative`.

Unknown fields are ignored, as OpenAI-compatible servers do. Text holding a lone surrogate
(JSON `"\\ud800"`) anywhere in a request body is a 400 naming the field (RequestBody).
Response shapes: responses.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from kog.speculation.params import MAX_SPECULATIVE_TOKENS
from kog.valid_text import lone_surrogate_at

MAX_TOP_LOGPROBS = 20
NAME_PATTERN = r"^[a-zA-Z0-9_.\-]{1,64}$"


class BodyModel(BaseModel):
    """Base of every request-body model: unknown fields are ignored (as OpenAI's API does) and
    fields are filled by name or alias."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class RequestBody(BodyModel):
    """A whole request body. Refuses text that has no UTF-8 form before any field is read: the
    tokenizer cannot take it, and an error that echoed it could not be sent."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        found = lone_surrogate_at(data)
        if found is not None:
            path, index, codepoint = found
            # NOTE: ctx.param is the field for the 400 (server/errors.py); the input is not quoted.
            raise PydanticCustomError(
                "invalid_text", "not valid Unicode text: it holds a lone surrogate ({codepoint} at character "
                "{index}); send UTF-8 text, or replace unpaired surrogates with U+FFFD",
                {"param": ".".join(map(str, path)) or "body", "codepoint": codepoint, "index": index})
        return data


class StreamOptions(BodyModel):
    include_usage: bool = False


# ---- tools ----------------------------------------------------------------------------------------
class FunctionDefinition(BodyModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, handed to the chat template as is
    strict: bool | None = None


class Tool(BodyModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BodyModel):
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BodyModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ToolCallFunction(BodyModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BodyModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# ---- response_format: decoding is constrained to it (server/structured.py, docs/STRUCTURED.md) ---
class ResponseFormatText(BodyModel):
    type: Literal["text"]


class ResponseFormatJsonObject(BodyModel):
    type: Literal["json_object"]


class JsonSchemaSpec(BodyModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatJsonSchema(BodyModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema],
                           Field(discriminator="type")]


# ---- speculative decoding (Kog extension) -----------------------------------------------------
class SpeculativeSpec(BodyModel):
    """kog.speculation.SpeculativeParams of one request; unknown keys are an error (a typo would
    otherwise silently fall back to the defaults)."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["ngram", "draft"] = "ngram"
    num_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS, strict=True)
    ngram_max: int = Field(3, ge=1, strict=True)
    ngram_min: int = Field(1, ge=1, strict=True)


# ---- messages -------------------------------------------------------------------------------------
class TextPart(BodyModel):
    type: Literal["text"]
    text: str


class ChatMessage(BodyModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # only text parts: Kog serves text models
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


# ---- requests -------------------------------------------------------------------------------------
class SamplingFields(RequestBody):
    """Fields shared by chat and text completions."""

    model: str
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # NOTE: bounded away from 0: logits / penalty must stay finite in float32 (a NaN fails the step)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # lower runs first (vLLM's convention)
    user: str | None = None
    # NOTE: absent = the server's --speculative default; null = off (model_fields_set tells them apart)
    speculative: SpeculativeSpec | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=0)  # 0: with echo, the prompt alone (scoring), as vLLM
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # with echo, the prompt's tokens' too
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's extension
    response_format: ResponseFormat | None = None
