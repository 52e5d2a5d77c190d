"""Chat templates: the Jinja2 program shipped with a model that turns messages into a prompt.

Rendered the way transformers' `apply_chat_template` renders them, so the prompt (and so the
prompt's tokens and any prefix-cache hit) is byte-identical to what the model was trained on:
a sandboxed environment with trim_blocks/lstrip_blocks, loop controls, the `{% generation %}`
tag, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and the
variables `messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`, `eos_token`.

Some templates drop `tools` (SmolLM2's renders the same prompt with or without them): a
ChatTemplate detects that (`ignores_tools`) and renders requests with tools through its
`tool_template` instead, when it has one; Kog ships one for ChatML models (`hermes_tools.jinja`).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kog.errors import InvalidRequest, ModelLoadError

log = logging.getLogger("kog")

# Kog's tool-aware ChatML template (Hermes tool calls), package data under python/kog/templates.
HERMES_TOOLS_TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "hermes_tools.jinja"
CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")

_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


class TemplateError(InvalidRequest):
    """The template rejected the conversation (its `raise_exception` was called)."""


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to.

    Attributes:
        tool_template: renders conversations with tools when this template ignores them (None:
            tools are rendered by this template, ignored or not; a warning says so once).
        allow_special_tokens_in_content: tokenize control-token text inside message contents as
            the control token (the old, unsafe behaviour); False: only the template's own markers
            are control tokens (kog.loader.chat_encoding).
    """

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 special_tokens: dict[str, str] | None = None, tool_template: ChatTemplate | None = None,
                 allow_special_tokens_in_content: bool = False):
        """Args:
            source: the Jinja2 text (tokenizer_config.json `chat_template`, GGUF `tokenizer.chat_template`).
            bos_token, eos_token: exposed to the template as `bos_token` / `eos_token`.
            special_tokens: further variables (`pad_token`, `unk_token`) some templates read.
            tool_template, allow_special_tokens_in_content: see the class attributes.
        """
        self.source = source
        self.variables = {"bos_token": bos_token or "", "eos_token": eos_token or "", **(special_tokens or {})}
        self.tool_template = tool_template
        self.allow_special_tokens_in_content = allow_special_tokens_in_content
        self._ignores_tools: bool | None = None
        self._warned = False
        try:
            self.template = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"chat template does not compile: {e.message} (line {e.lineno})") from None

    def ignores_tools(self) -> bool:
        """Whether the template renders a probe conversation the same with and without a tool
        (it never reads `tools`). A template that fails on the probe is taken to read them."""
        if self._ignores_tools is None:
            try:
                without = self._render(_PROBE_MESSAGES, None, True, None, {})
                self._ignores_tools = without == self._render(_PROBE_MESSAGES, _PROBE_TOOLS, True, None, {})
            except Exception:  # noqa: BLE001 - a probe the template rejects proves nothing
                self._ignores_tools = False
        return self._ignores_tools

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = False, documents: list[dict[str, Any]] | None = None,
               **kwargs: Any) -> str:
        """Renders a conversation into prompt text.

        Args:
            messages: OpenAI-style dicts (`role`, `content`, optional `tool_calls`, `name`, ...).
            tools: JSON-schema tool definitions, passed to the template as is.
            add_generation_prompt: end with the header that starts the assistant's reply.
            documents: retrieval documents, for templates that take them.
            **kwargs: extra template variables (e.g. `enable_thinking`).
        Returns:
            The prompt. Encode it with add_special_tokens=False: templates write BOS themselves.
            With tools and a template that ignores them, the render of `tool_template`.
        Raises:
            TemplateError: the template raised (e.g. roles do not alternate).
        """
        if tools and self.ignores_tools():
            if self.tool_template is not None:
                self._note_once("the model's chat template ignores `tools`; requests with tools are rendered "
                                "with Kog's tool template (Hermes format) instead")
                return self.tool_template.render(messages, tools, add_generation_prompt, documents, **kwargs)
            self._note_once("the chat template ignores `tools`: the model is not shown the tools of a request "
                            "(pass a tool-aware template with --chat-template)")
        return self._render(messages, tools, add_generation_prompt, documents, kwargs)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool, documents: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
        variables = {**self.variables, **kwargs, "messages": messages, "tools": tools,
                     "documents": documents, "add_generation_prompt": add_generation_prompt}
        try:
            return self.template.render(**variables)
        except _RaisedByTemplate as e:
            raise TemplateError(str(e)) from None

    def _note_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message)


def read_chat_template(value: str) -> str:
    """The template a `--chat-template` value names, as vLLM reads it: the text of the file at
    that path, else the value itself when it looks like Jinja (has `{`, `}` or a newline).

    Raises:
        ModelLoadError: neither a readable file nor a template.
    """
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a name too long for a path, a NUL byte: inline text
        is_file = False
    if is_file:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"chat template {value!r}: cannot read: {e}") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ModelLoadError(f"chat template {value!r} is neither a file nor a Jinja template")


def hermes_tool_template(bos_token: str | None = None, eos_token: str | None = None) -> ChatTemplate:
    """Kog's shipped tool-aware ChatML template (HERMES_TOOLS_TEMPLATE)."""
    return ChatTemplate(HERMES_TOOLS_TEMPLATE.read_text(encoding="utf-8"), bos_token, eos_token)


# ---------------------------------------------------------------------- internal helpers


class _RaisedByTemplate(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: unlike Jinja's built-in tojson this neither escapes HTML nor sorts keys: tool schemas
    # must reach the model exactly as HF renders them.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
