"""Chat templates: the Jinja2 program shipped with a model that turns messages into a prompt.

Rendered the way transformers' `apply_chat_template` renders them, so the prompt (and so the
prompt's tokens and any prefix-cache hit) is byte-identical to what the model was trained on:
a sandboxed environment with trim_blocks/lstrip_blocks, loop controls, the `{% generation %}`
tag, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and the
variables `messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`, `eos_token`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kog.errors import InvalidRequest, ModelLoadError


class TemplateError(InvalidRequest):
    """The template rejected the conversation (its `raise_exception` was called)."""


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 special_tokens: dict[str, str] | None = None):
        """Args:
            source: the Jinja2 text (tokenizer_config.json `chat_template`, GGUF `tokenizer.chat_template`).
            bos_token, eos_token: exposed to the template as `bos_token` / `eos_token`.
            special_tokens: further variables (`pad_token`, `unk_token`) some templates read.
        """
        self.source = source
        self.variables = {"bos_token": bos_token or "", "eos_token": eos_token or "", **(special_tokens or {})}
        try:
            self.template = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"chat template does not compile: {e.message} (line {e.lineno})") from None

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
        Raises:
            TemplateError: the template raised (e.g. roles do not alternate).
        """
        variables = {**self.variables, **kwargs, "messages": messages, "tools": tools,
                     "documents": documents, "add_generation_prompt": add_generation_prompt}
        try:
            return self.template.render(**variables)
        except _RaisedByTemplate as e:
            raise TemplateError(str(e)) from None


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
