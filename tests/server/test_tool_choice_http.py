"""tool_choice through the server (in process, fake model with pseudo-random logits): "required"
and named choices give OpenAI tool_calls whose arguments validate against the tool's parameters,
"none" leaves the output free, "auto" is free text that becomes a valid call once the model opens
one, parallel_tool_calls: false gives one call; whole and streamed."""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from kog.engine import AsyncEngine, LLMEngine
from kog.loader.tokenizer import tokenizer_from_gguf
from kog.server import ServerConfig, build_app
from kog.testing.fake_runner import FakeRunner
from kog.testing.tiny_models import tiny_tokenizer_metadata

from server_helpers import TEMPLATE, TOK, ScriptedRunner, make_engine

jsonschema = pytest.importorskip("jsonschema")

MSGS = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                         "hours": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_time"}}


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "tools": TOOLS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def assert_valid_calls(calls, names=("get_weather", "get_time")):
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("seed", range(4))
def test_required_gives_valid_tool_calls(client, seed):
    body = chat(client, tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert_valid_calls(choice["message"]["tool_calls"])


@pytest.mark.parametrize("parallel", [True, False])
def test_named_choice_calls_that_tool_only(client, parallel):
    body = chat(client, tool_choice=NAMED, parallel_tool_calls=parallel, temperature=1.0, seed=1, n=3,
                max_tokens=200)
    finished = [c for c in body["choices"] if c["finish_reason"] == "tool_calls"]
    assert finished
    for choice in body["choices"]:
        if choice["finish_reason"] == "length":  # parallel calls may go on until max_tokens, cut mid-call
            assert parallel and "get_weather" not in json.dumps(choice["message"])
            continue
        calls = choice["message"]["tool_calls"]
        assert_valid_calls(calls, names=("get_time",))
        if not parallel:
            assert len(calls) == 1


SEARCH = {"type": "function", "function": {"name": "search", "parameters": {  # nothing bounds a string or an array
    "type": "object", "properties": {"query": {"type": "string"}, "sites": {"type": "array", "items": {"type": "string"}},
                                     "options": {"type": "object", "properties": {"lang": {"type": "string"},
                                                                                  "safe": {"type": "boolean"}},
                                                 "required": ["lang"]}},
    "required": ["query", "options"]}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_max_tokens_never_costs_the_call(client, tool_choice, stream):
    """Random logits write strings without end (a shortest call is ~60 tokens here): near max_tokens
    the call is closed (kog.structured_output.call_budget), so every reply has a complete, valid call."""
    body = {"model": "kog", "messages": MSGS, "tools": [SEARCH], "tool_choice": tool_choice, "temperature": 1.0,
            "seed": 3, "n": 6, "max_tokens": 90, "stream": stream}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        replies = {i: [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []
                       if c["choices"] and c["choices"][0]["index"] == i] for i in range(6)}
    else:
        replies = {c["index"]: c["message"]["tool_calls"] for c in r.json()["choices"]}
    for calls in replies.values():
        assert calls
        for call in calls:
            assert call["function"]["name"] == "search"
            jsonschema.validate(json.loads(call["function"]["arguments"]), SEARCH["function"]["parameters"])


def test_none_leaves_the_output_free(make_client):
    plain = make_client()
    free = plain.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "max_tokens": 20,
                                                    "temperature": 0}).json()["choices"][0]["message"]
    # tools hidden from the template and no grammar: the same prompt and the same tokens as without tools
    none = chat(plain, tool_choice="none", max_tokens=20, temperature=0)["choices"][0]
    assert none["message"] == free and none["finish_reason"] != "tool_calls"


class OpensACallThenStops(ScriptedRunner):
    """Writes its script, then wants to end (EOS) whatever the context: a model that opens a
    tool call and never writes it."""

    def _logits(self, context):
        n = len(self.script)
        if any(context[i:i + n] == self.script for i in range(len(context) - n + 1)):
            row = torch.full((self.vocab_size,), -10.0)
            row[self.eos] = 10.0
            return row
        return super()._logits(context)


def test_auto_is_free_text_until_the_model_opens_a_call(make_client):
    client = make_client(make_engine(OpensACallThenStops(TOK.encode("Let me check. <tool_call>"), TOK.eos_token_id)))
    [choice] = chat(client, temperature=0, max_tokens=200)["choices"]
    assert choice["message"]["content"] == "Let me check."  # the free text is the model's own
    assert choice["finish_reason"] == "tool_calls"
    assert_valid_calls(choice["message"]["tool_calls"])  # the grammar wrote the call the model did not
    # without tools the same model stops right after the tag
    free = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "max_tokens": 200,
                                                     "temperature": 0}).json()["choices"][0]["message"]
    assert free["content"] == "Let me check. <tool_call>"


def test_auto_without_a_call_is_plain_content(client):
    [choice] = chat(client, temperature=0, max_tokens=12)["choices"]
    assert choice["message"]["tool_calls"] is None and choice["message"]["content"]


def test_streamed_tool_calls_reassemble(client):
    whole = chat(client, tool_choice="required", temperature=1.0, seed=2, max_tokens=200)["choices"][0]
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "tools": TOOLS, "stream": True,
                                                  "tool_choice": "required", "temperature": 1.0, "seed": 2,
                                                  "max_tokens": 200})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    deltas = [c["choices"][0] for c in (json.loads(e[6:]) for e in events[:-1]) if c["choices"]]
    calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    assert "".join(d["delta"].get("content") or "" for d in deltas).strip() == ""
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == \
        [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in whole["message"]["tool_calls"]]
    assert [t["index"] for t in calls] == list(range(len(calls)))
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_llama3_json_parser_still_reads_constrained_calls(make_client):
    client = make_client(tool_call_parser="llama3_json")
    [choice] = chat(client, tool_choice="required", temperature=1.0, seed=0, max_tokens=200)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert_valid_calls(choice["message"]["tool_calls"])


def test_session_generate_tool_choice(make_client):
    client = make_client(make_engine())
    sid = client.post("/v1/sessions", json={"messages": MSGS, "tools": TOOLS}).json()["id"]
    r = client.post(f"/v1/sessions/{sid}/generate", json={"tool_choice": NAMED, "temperature": 1.0, "seed": 4,
                                                          "max_tokens": 200})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert_valid_calls(choice["message"]["tool_calls"], names=("get_time",))


def test_tool_tags_that_are_special_tokens_still_parse():
    """A tokenizer with <tool_call> as a special token: the grammar writes the tag as that token
    and the reply keeps it in the text (skip_special_tokens would drop it), so the calls parse."""
    meta = tiny_tokenizer_metadata()
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + ["<tool_call>", "</tool_call>"]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [3, 3]  # control tokens
    tok = tokenizer_from_gguf(meta, source="tiny tokenizer with tool tags")
    engine = AsyncEngine(LLMEngine(FakeRunner(tok.vocab_size, 64, 4), tok, [tok.eos_token_id], 256))
    body = {"model": "kog", "messages": MSGS, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0,
            "seed": 1, "max_tokens": 200}
    try:
        with TestClient(build_app(engine, tok, TEMPLATE, ServerConfig(tool_call_parser="hermes"))) as client:
            [choice] = client.post("/v1/chat/completions", json=body).json()["choices"]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            assert_valid_calls(choice["message"]["tool_calls"])
            stream = client.post("/v1/chat/completions", json={**body, "stream": True}).text
            assert '"tool_calls":[{"index":0' in stream and "<tool_call>" not in stream
    finally:
        engine.close(timeout=10)
