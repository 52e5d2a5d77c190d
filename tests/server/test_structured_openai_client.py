"""Structured output and speculation through the official `openai` client against a real
`kog serve --speculative-model M --speculative draft:3` (tiny random-weight model drafting for
itself): response_format and tool_choice replies parse and validate, `extra_body` speculation
settings keep greedy output, a bad schema raises openai.BadRequestError, streamed or not."""

import json

import openai
import pytest

from kog.testing.server_process import API_KEY, ServerProcess, tiny_gguf

jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris? Answer as JSON."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = tiny_gguf(tmp_path_factory.mktemp("model"))
    server = ServerProcess(model, "--api-key", API_KEY, "--speculative-model", str(model), "--speculative", "draft:3")
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    server.stop()


def test_json_schema_reply_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, temperature=1.0,
                                         seed=1, max_tokens=120, n=2)
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_required_tool_call_streams_as_tool_calls(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                 temperature=1.0, seed=2, max_tokens=120, stream=True))
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert calls and all(t.function.name == "get_weather" for t in calls)
    for t in calls:
        jsonschema.validate(json.loads(t.function.arguments), TOOLS[0]["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_speculation_settings_keep_greedy_output(client):
    def text(spec):
        extra = {} if spec == "default" else {"speculative": spec}
        return client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True, **extra}).choices[0].text

    plain = text(None)
    assert text("default") == plain == text({"method": "ngram", "num_tokens": 2})
    assert text({"method": "draft", "num_tokens": 4}) == plain


@pytest.mark.parametrize("stream", [False, True])
def test_bad_schema_is_a_bad_request(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 5,
                                                                          "maximum": 2}}}
    with pytest.raises(openai.BadRequestError, match=r"minimum \(5\) is greater than maximum \(2\)"):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=fmt, stream=stream)
        list(out) if stream else None
