"""StructuredOutputParams -> an llguidance grammar (Lark text in llguidance's dialect).

Every kind becomes one Lark grammar so they compose: a JSON schema is `%json {...}` inside it,
a tool call is the model's call markers around the `%json` of `{"name": const, "arguments":
parameters}`, and tool_choice "auto" lets free text run until the model writes the opening
marker (a lazy lexeme: it ends at the first occurrence of the trigger), then constrains the call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llguidance import regex_to_lark

from kog.structured_output.params import StructuredOutputParams
from kog.structured_output.unique_items import enforce_unique_items

# Compact separators: a random or confused model cannot spend its budget on whitespace.
# NOTE: lenient: keywords llguidance does not implement (`not`, `if`/`then`/`else`, `contains`, ...,
# unknown `format`s) are ignored rather than refused; the compiler lists them as warnings
# (kog.structured_output.grammar logs them). `uniqueItems` over enum items is enforced first (unique_items.py).
LENIENT = {"lenient": True}
COMPACT_JSON = {**LENIENT, "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FLEXIBLE_JSON = {**LENIENT, "whitespace_flexible": True}


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes a tool call: begin + JSON {"name", "arguments"} + end, calls joined by sep."""

    begin: str
    end: str
    sep: str = "\n"


# Hermes / Qwen2.5+ / SmolLM: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
HERMES = ToolCallFormat(begin="<tool_call>\n", end="\n</tool_call>")


def lark_grammar(params: StructuredOutputParams, special_tokens: frozenset[str] = frozenset(),
                 tool_format: ToolCallFormat = HERMES) -> str:
    """The Lark grammar (llguidance dialect) a request's structured-output params describe.

    Args:
        params: validated StructuredOutputParams.
        special_tokens: the tokenizer's special tokens; a call marker that is one (e.g. a
            `<tool_call>` added as special) is matched as that token, not as text.
        tool_format: the model's tool-call syntax.

    Returns:
        Lark text with a `start` rule.
    """
    opts = FLEXIBLE_JSON if params.any_whitespace else COMPACT_JSON
    kind = params.kind
    if kind == "grammar":
        return params.grammar
    if kind == "regex":
        return f"start: /{regex_to_lark(params.regex, '')}/"
    if kind != "tools":
        return f"start: {_json(answer_schema(params), opts)}"
    return _tools_grammar(params, special_tokens, tool_format, opts)


def answer_schema(params: StructuredOutputParams) -> Any:
    """The JSON schema of a json_schema / json_object answer, as compiled (unique_items.py)."""
    return {"type": "object"} if params.json_object else enforce_unique_items(params.json_schema)


def tool_call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """`{"name": <this tool's name>, "arguments": <valid against its parameters>}`, in that order."""
    fn = tool["function"]
    return {"type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": parameters_schema(tool)},
            "required": ["name", "arguments"], "additionalProperties": False}


def parameters_schema(tool: dict[str, Any]) -> Any:
    """A tool's parameters schema, as compiled (unique_items.py); no parameters: any object."""
    return enforce_unique_items(tool["function"].get("parameters") or {"type": "object"})


# ---------------------------------------------------------------------- internal helpers


def _tools_grammar(params: StructuredOutputParams, special_tokens: frozenset[str], fmt: ToolCallFormat,
                   opts: dict[str, Any]) -> str:
    name = params.forced_tool()
    schemas = [tool_call_schema(t) for t in params.tools if name is None or t["function"]["name"] == name]
    tool = f"tool: {_json(schemas[0] if len(schemas) == 1 else {'anyOf': schemas}, opts)}\n"
    tag = fmt.begin.strip("\n")
    after_tag = _q(fmt.begin[fmt.begin.index(tag) + len(tag):])
    end = _marker(fmt.end, special_tokens)
    if params.tool_choice == "auto" and not params.answers():
        # Free text until the opening tag; a text trigger is a lazy lexeme (it ends at the first
        # occurrence of the tag), a special-token trigger cannot occur inside TEXT at all.
        trigger = _marker(tag, special_tokens)
        trig = f"trig[lazy]: TEXT {trigger}" if trigger.startswith('"') else f"trig: TEXT {trigger}"
        # NOTE: a lazy lexeme wins as soon as it matches, so the first tag always starts a call.
        start = "(trig call_rest)* TEXT" if params.parallel_tool_calls else "TEXT | trig call_rest"
        return (f"start: {start}\n{trig}\ncall_rest: {after_tag} tool {end}\n{tool}"
                "TEXT: /(.|\\n)*/\n")
    start = "calls"
    if params.answers():  # tool_choice "auto" with a JSON answer format: that JSON, or calls
        start = f"calls | {_json(answer_schema(params), opts)}"
    begin = f"{_marker(fmt.begin[:fmt.begin.index(tag)] + tag, special_tokens)} {after_tag}".rstrip()
    more = f" ({_q(fmt.sep)} call)*" if params.parallel_tool_calls else ""
    return f"start: {start}\ncalls: call{more}\ncall: {begin} tool {end}\n{tool}"


def _json(schema: Any, opts: dict[str, Any]) -> str:
    """`%json {...}` with Kog's options unless the schema sets its own x-guidance (lenient unless it says)."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**LENIENT, **schema["x-guidance"]} if "x-guidance" in schema else opts}
    return "%json " + json.dumps(schema)


def _marker(text: str, special_tokens: frozenset[str]) -> str:
    """A call marker: the special token itself when the tokenizer has one, else its text.

    A marker with leading/trailing newlines is split so only the bare tag can be a token."""
    core = text.strip("\n")
    if core in special_tokens:
        lead, trail = text[:text.index(core)], text[text.index(core) + len(core):]
        return " ".join(p for p in (_q(lead), core, _q(trail)) if p)
    return _q(text)


def _q(text: str) -> str:
    """A Lark string literal ("" -> nothing)."""
    return json.dumps(text) if text else ""


