"""Tool calls out of model text, in the two formats chat templates teach models:

- hermes (Hermes, Qwen2/2.5/3, SmolLM2/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, free text around them;
- llama3_json (Llama 3.1+): the whole reply is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several calls separated by `;`.

"auto" accepts both. Text that does not parse stays content: a malformed call is never dropped,
except an unclosed last Hermes block after complete ones (a reply cut by max_tokens mid-call).
A Hermes call's JSON is read as JSON, so a `</tool_call>` inside one of its strings is text.
While streaming, ToolStreamer holds text back from the first sign of a call to the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PARSERS = ("auto", "hermes", "llama3_json")


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ToolParseResult:
    content: str | None                      # text outside the calls (None when only calls)
    calls: list[ParsedToolCall] = field(default_factory=list)


def parse_tool_calls(text: str, parser: str = "auto") -> ToolParseResult:
    """Splits a finished reply into content and tool calls.

    Args:
        text: the model's whole reply.
        parser: "auto", "hermes" or "llama3_json".
    Returns:
        The calls found and the remaining content; calls is empty if any candidate is malformed
        (an unclosed last Hermes block that does not parse, after complete calls, is dropped).
    """
    if parser in ("auto", "llama3_json") and _json_start(text):
        calls = _parse_json_calls(text.strip().removeprefix(PYTHON_TAG))
        if calls is not None:
            return ToolParseResult(None, calls)
    if parser in ("auto", "hermes") and HERMES_START in text:
        return _parse_hermes(text)
    return ToolParseResult(text or None)


def content_end(text: str, parser: str = "auto") -> int:
    """How many leading characters of a partial reply are surely content: the rest is a tool call
    that has begun, or could begin (a prefix of `<tool_call>`, leading `{`)."""
    if parser in ("auto", "llama3_json"):
        stripped = text.lstrip()
        if not stripped or stripped[0] == "{" or stripped.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(stripped):
            return 0
        if parser == "llama3_json":
            return len(text)
    at = text.find(HERMES_START)
    if at != -1:
        return at
    for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if text.endswith(HERMES_START[:k]):
            return len(text) - k
    return len(text)


class ToolStreamer:
    """Streams content while holding back anything that is, or may become, a tool call.

    Args:
        parser: as parse_tool_calls.
    """

    def __init__(self, parser: str = "auto") -> None:
        self.parser = parser
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> str:
        """Adds a text delta; returns the content that can be sent now."""
        self.text += delta
        end = max(self.emitted, content_end(self.text, self.parser))
        out, self.emitted = self.text[self.emitted:end], end
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """Returns (content still to send, tool calls) once the reply is complete."""
        result = parse_tool_calls(self.text, self.parser)
        end = max(self.emitted, content_end(self.text, self.parser)) if result.calls else len(self.text)
        rest, self.emitted = self.text[self.emitted:end], end
        return rest, result.calls


# ---------------------------------------------------------------------- internal helpers


def _json_start(text: str) -> bool:
    stripped = text.lstrip()
    return stripped.startswith("{") or stripped.startswith(PYTHON_TAG)


def _parse_hermes(text: str) -> ToolParseResult:
    """`<tool_call>` JSON `</tool_call>` blocks and the text around them. The end tag may be
    missing or cut at the end of the reply; a last block cut inside its JSON is dropped when
    complete calls precede it; any other block that is not a call makes the whole reply content."""
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    content, pos = [], 0
    while (at := text.find(HERMES_START, pos)) >= 0:
        content.append(text[pos:at])
        start = _skip_space(text, at + len(HERMES_START))
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            if calls and HERMES_END not in text[start:]:  # cut mid-call (max_tokens): dropped
                pos = len(text)
                break
            return ToolParseResult(text or None)
        call, end = _to_call(obj), _skip_space(text, end)
        closed = text.startswith(HERMES_END, end)
        if call is None or not (closed or HERMES_END.startswith(text[end:])):  # junk before the end tag
            return ToolParseResult(text or None)
        calls.append(call)
        pos = end + len(HERMES_END) if closed else len(text)
    content.append(text[pos:])
    rest = "".join(content).strip()
    return ToolParseResult(rest or None, calls)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _to_call(obj: object) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        if not isinstance(_loads(args), dict):
            return None
        return ParsedToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _parse_json_calls(text: str) -> list[ParsedToolCall] | None:
    """One or more JSON objects separated by `;` (or whitespace); None unless all are calls."""
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _to_call(obj)
        if call is None:
            return None
        calls.append(call)
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
    return calls or None
