"""A constraint that does not compile is an HTTP 400 OpenAI error naming the fault, before any
token and before the response starts (also with stream: true), and leaves nothing behind: no
request in the engine, no KV block, no prefill computed."""

import pytest

from kog.server import structured

from server_helpers import make_engine

MSGS = [{"role": "user", "content": "hi"}]


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def tool(parameters, name="f"):
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# (body fields, the param blamed, words the message must contain)
BAD = {
    "invalid schema": ({"response_format": schema_format({"type": "strin"})}, "response_format",
                       ["answer", "Invalid type: strin"]),
    # unimplemented keywords are relaxed (test_structured_http.py) unless the schema turns lenient mode off
    "unsupported keyword, strict": ({"response_format": schema_format({"not": {"type": "integer"},
                                                                       "x-guidance": {"lenient": False}})},
                                    "response_format", ["Unimplemented keys", "not"]),
    "unsatisfiable schema": ({"response_format": schema_format({"type": "integer", "minimum": 5, "maximum": 2})},
                             "response_format", ["minimum (5) is greater than maximum (2)"]),
    "bad pattern": ({"response_format": schema_format({"type": "string", "pattern": "[a-"})}, "response_format",
                    ["regex", "unclosed character class"]),
    "remote $ref": ({"response_format": schema_format({"$ref": "https://example.com/s.json"})}, "response_format",
                    ["https://example.com/s.json"]),
    "tool parameters": ({"tools": [tool({"type": "object"}, "ok"), tool({"type": "integer", "minimum": 3,
                                                                       "maximum": 1}, "broken")],
                         "tool_choice": "required"}, "tools", ["'broken'", "minimum (3) is greater than maximum (1)"]),
    "tool parameters, auto": ({"tools": [tool({"type": "string", "pattern": "(("})]}, "tools", ["'f'", "regex"]),
    # found by test_schemathesis.py: llguidance cannot serialize an integer outside int64 (a 500 before)
    "tool parameters, huge integer": ({"tools": [tool({"type": "integer", "maximum": -2**63 - 1}, "big")]}, "tools",
                                      ["'big'", "-9223372036854775809"]),
    "schema missing": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
                       ["schema"]),
}


def engine_is_untouched(client, before):
    state = client.app.state.kog
    stats = state.engine.stats()
    assert state.engine.engine._requests == {}
    for key in ("blocks_used", "blocks_free", "blocks_cached"):  # a session's context keeps its blocks, no more
        assert stats["kv"][key] == before["kv"][key], key
    assert stats["prefill_tokens_computed"] == before["prefill_tokens_computed"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_constraint_is_a_400_before_any_token(client, case, stream):
    fields, param, words = BAD[case]
    before = client.app.state.kog.engine.stats()
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "stream": stream, **fields})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert client.app.state.kog.engine.stats()["kv"]["blocks_used"] == 0
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    for word in words:
        assert word in error["message"]
    assert "at 1(" not in error["message"]
    engine_is_untouched(client, before)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_and_sessions_refuse_bad_schemas(client, stream):
    bad = schema_format({"type": "integer", "minimum": 5, "maximum": 2})
    sid = client.post("/v1/sessions", json={"messages": MSGS}).json()["id"]
    before = client.app.state.kog.engine.stats()
    for path, body in [("/v1/completions", {"model": "kog", "prompt": "hi"}), (f"/v1/sessions/{sid}/generate", {})]:
        r = client.post(path, json={**body, "stream": stream, "response_format": bad})
        assert r.status_code == 400 and "minimum (5) is greater than maximum (2)" in r.json()["error"]["message"]
    assert client.get(f"/v1/sessions/{sid}").json()["busy"] is False
    engine_is_untouched(client, before)


def test_tool_choice_on_a_session_without_tools(client):
    sid = client.post("/v1/sessions", json={"messages": MSGS}).json()["id"]
    r = client.post(f"/v1/sessions/{sid}/generate", json={"tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_the_engine_refuses_what_the_server_check_would_have(make_client, monkeypatch):
    """Without the server's compile, the engine's own at add_request still answers 400 before any token."""
    async def skip(state, params):
        return None

    monkeypatch.setattr("kog.server.routes.chat.check_compiles", skip)
    client = make_client(make_engine())
    before = client.app.state.kog.engine.stats()
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "stream": stream,
                                                      **BAD["unsatisfiable schema"][0]})
        assert r.status_code == 400 and "minimum (5) is greater than maximum (2)" in r.json()["error"]["message"]
    engine_is_untouched(client, before)


def test_a_valid_schema_is_compiled_once_for_the_engine(client, monkeypatch):
    """The server's compile fills the grammar cache: the engine's compile is a cache hit."""
    from kog.structured_output import grammar

    compiled = []
    real = grammar._compile
    monkeypatch.setattr(grammar, "_compile", lambda *a: compiled.append(1) or real(*a))
    fmt = schema_format({"type": "object", "properties": {"never_seen_before": {"type": "boolean"}},
                         "required": ["never_seen_before"], "additionalProperties": False})
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "response_format": fmt,
                                                  "max_tokens": 50})
    assert r.status_code == 200 and len(compiled) == 1
    assert structured.tool_parser("llama3_json", None) == "llama3_json"
