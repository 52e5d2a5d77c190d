"""response_format through the server (in process, the fake model of kog.testing.fake_runner, whose
logits are pseudo-random): json_schema replies validate, json_object replies parse, on chat,
text completions and session generations, whole and streamed, sampled at temperature 1."""

import json
import random

import pytest

from kog.testing.structured import PERSON_SCHEMA as PERSON, random_schema

from server_helpers import TOK, ScriptedRunner, make_engine

jsonschema = pytest.importorskip("jsonschema")

MSGS = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMAS = [PERSON, {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1,
                    "maxItems": 3},
           {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "string",
                                                                                "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
            "required": ["ok", "code"], "additionalProperties": False}]
SCHEMAS += [random_schema(random.Random(seed)) for seed in range(5)]


def json_schema(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def sse_chunks(response):
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_replies_validate(client, i):
    body = chat(client, response_format=json_schema(SCHEMAS[i]), temperature=1.0, seed=i, n=2, max_tokens=200)
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[i])


def test_unconstrained_reply_is_not_json(client):
    """The control: the same fake model without response_format writes no JSON (so the grammar did the work)."""
    text = chat(client, temperature=1.0, seed=0, max_tokens=40)["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(text)


def test_json_object_replies_parse(make_client):
    scripted = make_client(make_engine(ScriptedRunner(TOK.encode('{"a": [1, 2], "b": "x"}'), TOK.eos_token_id)))
    body = chat(scripted, response_format={"type": "json_object"}, temperature=0, max_tokens=100)
    assert json.loads(body["choices"][0]["message"]["content"]) == {"a": [1, 2], "b": "x"}
    # random logits: nothing bounds an object's size, but every reply is one from its first character
    body = chat(make_client(), response_format={"type": "json_object"}, temperature=1.0, seed=3, n=3, max_tokens=60)
    for choice in body["choices"]:
        text = choice["message"]["content"]
        assert text.startswith("{")
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)


def test_text_format_is_free(client):
    free = chat(client, temperature=0, max_tokens=12)["choices"][0]["message"]["content"]
    assert chat(client, temperature=0, max_tokens=12, response_format={"type": "text"})["choices"][0]["message"][
        "content"] == free


def test_streamed_json_reassembles_to_the_whole_reply(client):
    fmt = json_schema(PERSON)
    whole = chat(client, response_format=fmt, temperature=1.0, seed=11, max_tokens=200)
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "response_format": fmt,
                                                  "temperature": 1.0, "seed": 11, "max_tokens": 200, "stream": True})
    chunks = sse_chunks(r)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_text_completion_response_format(client):
    r = client.post("/v1/completions", json={"model": "kog", "prompt": ["a person:", "another:"], "max_tokens": 200,
                                             "temperature": 1.0, "seed": 5, "response_format": json_schema(PERSON)})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for c in choices:
        jsonschema.validate(json.loads(c["text"]), PERSON)


def test_session_generate_response_format(make_client):
    client = make_client(make_engine())
    sid = client.post("/v1/sessions", json={"messages": MSGS}).json()["id"]
    r = client.post(f"/v1/sessions/{sid}/generate", json={"response_format": json_schema(PERSON), "temperature": 1.0,
                                                          "seed": 2, "max_tokens": 200})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), PERSON)


COLORS = ["red", "green", "blue", "cyan", "black"]
UNIQUE = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": COLORS}, "uniqueItems": True,
                                                      "minItems": 2}},
          "required": ["colors"], "additionalProperties": False}


def test_unique_items_over_an_enum_never_repeat(client):
    """uniqueItems (which llguidance does not implement) over enum items is enforced, answer or tool call."""
    body = chat(client, response_format=json_schema(UNIQUE), temperature=1.0, seed=4, n=8, max_tokens=200)
    tools = [{"type": "function", "function": {"name": "paint", "parameters": UNIQUE}}]
    calls = chat(client, tools=tools, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=4, n=8,
                 max_tokens=200)
    replies = [json.loads(c["message"]["content"]) for c in body["choices"]]
    replies += [json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]) for c in calls["choices"]]
    for reply in replies:
        jsonschema.validate(reply, UNIQUE)  # jsonschema checks uniqueItems
    assert len(replies) == 16


IMPLEMENTED = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "code": {"type": "string", "maxLength": 6},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                        "maxItems": 3}},
               "required": ["n", "code", "tags"], "additionalProperties": False}
RELAXED = {**IMPLEMENTED, "dependentRequired": {"n": ["code"]}, "properties": {  # + keywords llguidance lacks
    "n": {**IMPLEMENTED["properties"]["n"], "not": {"const": 3}},
    "code": {**IMPLEMENTED["properties"]["code"], "format": "isbn"},
    "tags": {**IMPLEMENTED["properties"]["tags"], "uniqueItems": True}}}


@pytest.mark.parametrize("stream", [False, True])
def test_unimplemented_keywords_are_served(client, stream):
    """Keywords the grammar library does not implement are relaxed (docs/STRUCTURED.md lists them), not refused:
    the reply is 200 and keeps every constraint that is implemented."""
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "stream": stream, "seed": 1,
                                                  "response_format": json_schema(RELAXED), "temperature": 1.0,
                                                  "max_tokens": 200})
    assert r.status_code == 200, r.text
    text = ("".join(c["choices"][0]["delta"].get("content") or "" for c in sse_chunks(r) if c["choices"]) if stream
            else r.json()["choices"][0]["message"]["content"])
    jsonschema.validate(json.loads(text), IMPLEMENTED)
