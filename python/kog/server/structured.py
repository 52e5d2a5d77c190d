"""A request's output constraint (response_format, tools, tool_choice, parallel_tool_calls) as
the engine's StructuredOutputParams, compiled before the request is queued.

Why compile here rather than leave it to `LLMEngine.add_request`: the engine compiles on its
loop thread, where a 10-50 ms compile stalls the next step of every running request. Compiling
first in a worker thread fills kog.structured_output.grammar's cache of compiled grammars (the engine's own
compile is then a fork, ~0.1 ms) and turns a bad schema into a 400 before anything is queued:
no KV block is ever allocated for it. NOTE: the engine still compiles at add_request, so a
grammar evicted from the cache in between is only slower, never unchecked.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from pydantic import BaseModel

from kog.errors import InvalidRequest
from kog.loader.tokenizer import Tokenizer
from kog.sampling_params import SamplingParams
from kog.server.errors import APIError
from kog.server.state import ServerState
from kog.server.tool_parsers import HERMES_END, HERMES_START
from kog.structured_output.params import StructuredOutputParams

# llguidance prefixes schema errors with a position in the Lark grammar Kog wraps the schema in,
# which means nothing to the client: "at 1(8): failed to compile JSON schema: ..."
_GRAMMAR_POSITION = re.compile(r"\bat \d+\(\d+\): ")


def structured_params(response_format: BaseModel | None, tools: list[dict[str, Any]] | None,
                      tool_choice: str | BaseModel | None, parallel_tool_calls: bool) -> StructuredOutputParams | None:
    """The constraint a request asks for (None: free output), as StructuredOutputParams.from_openai
    builds it: json_object / json_schema answers, tool calls for tool_choice "required" or a named
    function, free text until a tool call opens for "auto", nothing for "none".

    Args:
        response_format: the validated `response_format` (protocol.ResponseFormat) or None.
        tools: tool definitions as dicts (`{"type": "function", "function": {...}}`).
        tool_choice: "none", "auto", "required", a protocol.NamedToolChoice, or None (OpenAI's
            default: "auto" with tools, "none" without).
        parallel_tool_calls: False allows one call.

    Raises:
        APIError: 400 naming the field at fault (tool_choice without tools, a schema missing, ...).
    """
    choice = tool_choice.model_dump() if isinstance(tool_choice, BaseModel) else tool_choice
    if not tools and choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice needs `tools`", param="tool_choice")
    fmt = response_format.model_dump(by_alias=True, exclude_none=True) if response_format is not None else None
    try:
        return StructuredOutputParams.from_openai(fmt, tools or None, choice, parallel_tool_calls)
    except InvalidRequest as e:
        raise APIError(400, str(e), param=_blame(str(e))) from None


async def check_compiles(state: ServerState, structured: StructuredOutputParams | None) -> None:
    """Compiles the constraint for the served model in a worker thread (and caches it).

    Raises:
        APIError: 400 with the compiler's reason: invalid or unsatisfiable schema, unsupported
            keyword, bad regex / pattern, tool parameters that do not compile.
    """
    if structured is None:
        return
    from kog.structured_output.grammar import build_constraint  # llguidance only once a request needs it

    engine = state.engine.engine
    try:
        await asyncio.to_thread(build_constraint, engine.tokenizer, structured, engine.eos_token_ids,
                                engine.runner.vocab_size)
    except InvalidRequest as e:
        param = "tools" if structured.kind == "tools" else "response_format"
        raise APIError(400, _GRAMMAR_POSITION.sub("", str(e)), param=param) from None


def tool_parser(configured: str, structured: StructuredOutputParams | None) -> str:
    """The parser for a reply to a request with tools. A constrained reply's calls are in the
    grammar's Hermes tags (kog.structured_output.formats), which the llama3_json parser does not read."""
    if structured is not None and structured.kind == "tools" and configured == "llama3_json":
        return "auto"
    return configured


def keep_tool_tags(params: SamplingParams, tokenizer: Tokenizer) -> None:
    """Keeps special tokens' text in a tool-call reply whose tags are special tokens of the
    tokenizer: the grammar writes the tags as those tokens, and skip_special_tokens would drop
    them from the text, where the parser looks for them. (A stop token never reaches the text.)"""
    if params.structured is None or params.structured.kind != "tools":
        return
    specials = {t.content for t in tokenizer.hf.get_added_tokens_decoder().values() if t.special}
    if HERMES_START in specials or HERMES_END in specials:
        params.skip_special_tokens = False


def _blame(message: str) -> str:
    """The request field a from_openai message is about (it starts with or names the field)."""
    for field in ("response_format", "tool_choice", "parallel_tool_calls"):
        if field in message:
            return field
    return "tools" if "tool" in message else "response_format"
