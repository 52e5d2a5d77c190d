"""A chat request's prompt: OpenAI messages and tools rendered through the model's chat template."""

from __future__ import annotations

import json
from typing import Any

from kog.loader.chat_encoding import encode_conversation
from kog.loader.chat_template import ChatTemplate
from kog.loader.tokenizer import Tokenizer
from kog.server.errors import APIError
from kog.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice


def active_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the model is shown: none for tool_choice "none", only the named one for a named
    choice, all of them for "auto"/"required" (the default is "auto" when tools are given).

    A tool_choice without tools is refused by server.structured.structured_params, which the
    chat route calls first.

    Raises:
        APIError: tool_choice names a tool that was not given.
    """
    choice = req.tool_choice
    if not req.tools or choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not tools:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in `tools`",
                           param="tool_choice")
    return tools


def encode_chat(req: ChatCompletionRequest, template: ChatTemplate | None, tokenizer: Tokenizer,
                tools: list[dict[str, Any]] | None) -> list[int]:
    """Renders the conversation (with tools) and tokenizes it.

    Raises:
        APIError: the model has no chat template.
        InvalidRequest: the template rejected the conversation (TemplateError).
    """
    return encode_messages([message_dict(m) for m in req.messages], template, tokenizer, tools,
                           req.add_generation_prompt, req.chat_template_kwargs)


def encode_messages(messages: list[dict[str, Any]], template: ChatTemplate | None, tokenizer: Tokenizer,
                    tools: list[dict[str, Any]] | None, add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """encode_chat for messages already in template form (message_dict); same errors.

    Control-token text in the messages and tools is tokenized as plain text unless the template
    allows it (kog.loader.chat_encoding)."""
    if template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    return encode_conversation(template, tokenizer, messages, tools, add_generation_prompt,
                               **(chat_template_kwargs or {}))


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """The dict a chat template expects: text content as one string, tool-call arguments as
    objects (templates write them with tojson), unset fields left out."""
    out: dict[str, Any] = {"role": m.role}
    if isinstance(m.content, list):
        out["content"] = "".join(p.text for p in m.content)
    else:
        out["content"] = m.content if m.content is not None else ""
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type,
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
