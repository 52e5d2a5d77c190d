"""Tool-call parsing: Hermes/Qwen/SmolLM blocks, Llama-3 bare JSON, malformed calls kept as text,
and the streaming hold-back that never leaks part of a call as content."""

import json

import pytest

from kog.server.tool_parsers import ToolStreamer, content_end, parse_tool_calls

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Tōkyō", "unit": "c"}}'


def args(call):
    return json.loads(call.arguments)


def test_hermes_blocks_and_content():
    r = parse_tool_calls(HERMES, "hermes")
    assert [c.name for c in r.calls] == ["get_weather", "get_time"]
    assert args(r.calls[0]) == {"city": "Paris"} and args(r.calls[1]) == {"tz": "CET"}
    assert r.content == "Let me check."


def test_hermes_unclosed_last_block_and_string_arguments():
    r = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}', "auto")
    assert [(c.name, args(c)) for c in r.calls] == [("f", {"x": 1})] and r.content is None


def test_llama3_json_single_multiple_and_python_tag():
    r = parse_tool_calls(LLAMA, "llama3_json")
    assert r.content is None and r.calls[0].name == "get_weather"
    assert args(r.calls[0]) == {"city": "Tōkyō", "unit": "c"}
    r = parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": [1]}}', "auto")
    assert [(c.name, args(c)) for c in r.calls] == [("a", {}), ("b", {"k": [1]})]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("cut", ['\n<tool_call>\n{"name": "get_weather", "argu', "\n<tool_call>", "\n<tool_call>\n{",
                                 '\n<tool_call>\n{"name": "f", "arguments": {"x": "a</tool_'])
def test_complete_calls_survive_a_cut_last_call(cut):
    """max_tokens cut the reply in its third call: the two complete calls are the reply, whole or streamed."""
    text = f"{CALL}\n{CALL}{cut}"
    r = parse_tool_calls(text, "auto")
    assert [(c.name, args(c)) for c in r.calls] == [("get_weather", {"city": "Paris"})] * 2 and r.content is None
    s = ToolStreamer("hermes")
    sent = "".join(s.feed(text[i:i + 5]) for i in range(0, len(text), 5))
    rest, calls = s.finish()
    assert sent + rest == "" and len(calls) == 2


def test_an_end_tag_inside_a_json_string_is_text():
    inner = '<tool_call>\n{"name": "sql", "arguments": {"q": "SELECT 1 </tool_call> <tool_call>"}}\n</tool_call>'
    r = parse_tool_calls(f"{inner}\n{CALL}", "hermes")
    assert [(c.name, args(c)) for c in r.calls] == [("sql", {"q": "SELECT 1 </tool_call> <tool_call>"}),
                                                    ("get_weather", {"city": "Paris"})] and r.content is None


def test_a_call_cut_in_its_end_tag_is_complete():
    r = parse_tool_calls(f"Sure.\n{CALL[:-4]}", "hermes")
    assert [(c.name, args(c)) for c in r.calls] == [("get_weather", {"city": "Paris"})] and r.content == "Sure."


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "argu',          # the only call is cut: nothing to return but the text
    f"{CALL}\n<tool_call>{{not json}}</tool_call>",         # a closed call that does not parse is malformed
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',              # no name
    '{"name": "f", "parameters": [1, 2]}',                   # arguments not an object
    '{"answer": 42}',                                        # JSON, but not a call
    "plain text with { braces }",
])
def test_malformed_calls_stay_content(text):
    r = parse_tool_calls(text, "auto")
    assert r.calls == [] and r.content == text


def test_parser_choice_matters():
    assert parse_tool_calls(LLAMA, "hermes").calls == []
    assert parse_tool_calls(HERMES, "llama3_json").calls == []


def test_content_end_holds_back_marker_prefixes():
    assert content_end("Hello <tool", "hermes") == len("Hello ")
    assert content_end("Hello <tool_call>{", "hermes") == len("Hello ")
    assert content_end("Hello <b>", "hermes") == len("Hello <b>")
    assert content_end("  {", "llama3_json") == 0 and content_end("Sure", "llama3_json") == 4
    assert content_end("<|pyth", "auto") == 0


@pytest.mark.parametrize("parser", ["auto", "hermes"])
def test_streamer_never_emits_part_of_a_call(parser):
    s = ToolStreamer(parser)
    sent = "".join(s.feed(HERMES[i:i + 3]) for i in range(0, len(HERMES), 3))
    rest, calls = s.finish()
    assert "<" not in sent + rest and (sent + rest).startswith("Let me check.")
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_streamer_releases_held_text_when_no_call():
    s = ToolStreamer("auto")
    text = "a < b and {x} <tool"
    sent = "".join(s.feed(ch) for ch in text)
    rest, calls = s.finish()
    assert calls == [] and sent + rest == text
