"""Per-request settings for structured output (off by default).

These are plain dataclasses with no llguidance or model import, so `SamplingParams` can carry
them and validate their shape up front; `kog.structured_output.grammar.build_constraint` compiles a
`StructuredOutputParams` into a grammar (and raises `InvalidRequest` for what only the compiler
can see: an unsatisfiable schema, an unsupported keyword, a lark syntax error).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kog.errors import InvalidRequest

TOOL_CHOICES = ("auto", "required")


@dataclass
class StructuredOutputParams:
    """What the output must look like. Set exactly one of json_schema, json_object, grammar, regex
    or tools (tools with tool_choice "auto" may also take json_schema / json_object: the answer
    is then either that JSON or tool calls).

    Args:
        json_schema: the output is JSON valid against this schema (a dict, or its JSON text).
        json_object: the output is any JSON object.
        grammar: a Lark grammar in llguidance's dialect (`start:` rule; `%json {...}` allowed).
        regex: the output matches this regular expression (Rust `regex` syntax).
        tools: OpenAI tool definitions (`{"type": "function", "function": {"name", "parameters"}}`).
        tool_choice: "auto" (free text, constrained once the model opens a tool call),
            "required" (one or more calls to any of the tools), or
            `{"type": "function", "function": {"name": NAME}}` (calls to that tool only).
        parallel_tool_calls: with tools, allow several calls in one reply (OpenAI's default);
            False: exactly one call (tool_choice "required" / named), at most one ("auto").
        any_whitespace: allow any JSON whitespace between tokens; False (default) fixes the
            separators to ", " and ": " so a model cannot loop on blank lines.
        name: the schema's name (from `response_format.json_schema.name`), used in error messages.
        jump_forward: the engine appends the tokens the grammar forces (a tool call's fixed
            text) without sampling them, computing them in one forward; False: one step each.
    """

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    grammar: str | None = None
    regex: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    any_whitespace: bool = False
    name: str | None = None
    jump_forward: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except ValueError as e:
                raise InvalidRequest(f"json_schema is not valid JSON: {e}") from None
        self.validate()

    @property
    def kind(self) -> str:
        """"tools", "json_schema", "json_object", "grammar" or "regex"."""
        if self.tools is not None:
            return "tools"
        return self.answers()[0]

    def forced_tool(self) -> str | None:
        """The tool name a `{"type": "function", ...}` tool_choice names, else None."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    def validate(self) -> None:
        """Raise InvalidRequest naming the first field that is malformed or conflicting."""
        answer = self.answers()
        if self.tools is None:
            if self.tool_choice is not None:
                raise InvalidRequest("structured: tool_choice needs tools")
            if len(answer) != 1:
                raise InvalidRequest("structured: set exactly one of json_schema, json_object, grammar, regex, "
                                     f"tools; got {answer or 'none'}")
        else:
            _check_tools(self.tools, self.tool_choice)
            if answer and (self.tool_choice != "auto" or answer not in (["json_schema"], ["json_object"])):
                raise InvalidRequest(f"structured: {answer} cannot be combined with tool_choice "
                                     f"{self.tool_choice!r} (only json_schema or json_object with 'auto')")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise InvalidRequest(f"json_schema must be a JSON object, got {type(self.json_schema).__name__}")
        for k in ("grammar", "regex"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise InvalidRequest(f"structured.{k} must be a string")

    def answers(self) -> list[str]:
        """The answer formats set (json_object counts when True, the others when not None)."""
        return [k for k in ("json_schema", "json_object", "grammar", "regex")
                if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None)]

    @classmethod
    def from_openai(cls, response_format: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
                    tool_choice: str | dict[str, Any] | None = None,
                    parallel_tool_calls: bool = True) -> StructuredOutputParams | None:
        """The constraint an OpenAI chat request asks for, or None when its output is free.

        Args:
            response_format: `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
            tools: the request's tool definitions.
            tool_choice: "none", "auto" (OpenAI's default when tools are given), "required" or a
                named function. "auto" adds a constraint only once the model opens a tool call.
            parallel_tool_calls: False allows one call per reply.

        Returns:
            StructuredOutputParams, or None (no constraint).
        """
        kwargs: dict[str, Any] = {}
        kind = (response_format or {}).get("type", "text")
        if kind == "json_object":
            kwargs["json_object"] = True
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise InvalidRequest("response_format.json_schema must be an object with a 'schema'")
            kwargs.update(json_schema=spec["schema"], name=spec.get("name"))
        elif kind != "text":
            raise InvalidRequest(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
        if tools and choice != "none":
            if choice != "auto":  # a forced tool call: its arguments' schema is the answer's format
                kwargs = {}
            kwargs.update(tools=tools, tool_choice=choice, parallel_tool_calls=parallel_tool_calls)
        return cls(**kwargs) if kwargs else None


# ---------------------------------------------------------------------- internal helpers


def _check_tools(tools: Any, tool_choice: Any) -> None:
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("tools must be a non-empty list of tool definitions")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}].function.name must be a non-empty string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tools: duplicate function names in {names}")
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not among the tools {names}")
    elif tool_choice not in TOOL_CHOICES:
        raise InvalidRequest(f"tool_choice must be 'auto', 'required' or a named function, got {tool_choice!r}")
