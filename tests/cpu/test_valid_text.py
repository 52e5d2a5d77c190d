"""A lone surrogate in any text the Python API tokenizes is a kog.InvalidRequest naming the
argument, never a TypeError from the tokenizer."""

from __future__ import annotations

import pytest

import kog
from kog.engine import EngineConfig, LLMEngine
from kog.loader import ChatTemplate
from kog.testing.fake_runner import FakeRunner
from kog.testing.tiny_models import CHATML_TEMPLATE, tiny_tokenizer
from kog.valid_text import lone_surrogate_at

TOK = tiny_tokenizer()
BAD = "x\udc80y"
PARAMS = kog.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": BAD}}]


@pytest.fixture
def llm():
    engine = LLMEngine(FakeRunner(TOK.vocab_size, 128, 4), TOK, [TOK.eos_token_id], 512,
                       EngineConfig(max_num_batched_tokens=32))
    return kog.LLM.from_engine(engine, TOK, ChatTemplate(CHATML_TEMPLATE))


def invalid(field: str):
    return pytest.raises(kog.InvalidRequest, match=rf"^{field} is not valid Unicode text: .*U\+DC80 at character 1")


def test_generate_names_the_prompt(llm):
    with invalid(r"prompts\[0\]"):
        llm.generate(BAD, PARAMS)
    with invalid(r"prompts\[1\]\['prompt'\]"):
        llm.generate(["fine", {"prompt": BAD}], PARAMS)


@pytest.mark.parametrize("message, field", [
    ({"role": "user", "content": BAD}, r"messages\[1\]\['content'\]"),
    ({"role": "user", "name": BAD, "content": "hi"}, r"messages\[1\]\['name'\]"),
    ({"role": "tool", "content": BAD}, r"messages\[1\]\['content'\]"),
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": {"q": BAD}}}]}, r"messages\[1\]\['tool_calls'\]\[0\]\['function'\]\['arguments'\]\['q'\]"),
])
def test_chat_names_the_message_field(llm, message, field):
    with invalid(field):
        llm.chat([{"role": "user", "content": "hi"}, message], PARAMS)


def test_chat_names_the_tools(llm):
    with invalid(r"tools\[0\]\['function'\]\['description'\]"):
        llm.chat([{"role": "user", "content": "hi"}], PARAMS, tools=TOOLS)


def test_stop_strings_are_checked(llm):
    with invalid(r"stop\[0\]"):
        llm.generate("hi", kog.SamplingParams(max_tokens=2, stop=BAD))


def test_sessions_name_the_message_field(llm):
    with invalid(r"messages\[0\]\['content'\]"):
        llm.session(messages=[{"role": "system", "content": BAD}])
    with llm.session(messages=[{"role": "system", "content": "tools"}]) as s:
        before = s.token_ids
        with invalid(r"messages\[1\]\['content'\]"):
            s.append(messages=[{"role": "tool", "content": BAD}])
        assert s.token_ids == before and len(s.messages) == 1


def test_the_tokenizer_itself_raises_invalid_request():
    with pytest.raises(kog.InvalidRequest, match=r"^text is not valid Unicode text"):
        TOK.encode(BAD)
    with pytest.raises(kog.InvalidRequest):
        TOK.encode_plain(BAD)


def test_lone_surrogate_at_finds_the_first_in_nested_values():
    assert lone_surrogate_at({"a": ["ok", {"b": "\ud800"}]}) == (("a", 1, "b"), 0, "U+D800")
    assert lone_surrogate_at({"\udfff": 1}) == ((), 0, "U+DFFF")  # a key
    assert lone_surrogate_at(["emoji \U0001F600", "é", 3, None]) is None
