"""/v1/sessions in process over the fake model (turns equal stateless chat, fork, rollback,
suspend, delete, errors, 409 on a busy session, KV freed, a delete ends the generation in
flight), and against a real `kog serve` (a disconnect mid-stream aborts the generation and
leaves the context as it was)."""

import json
import threading
import time

import httpx
import pytest

from kog.testing.fake_runner import FakeRunner
from kog.testing.server_process import API_KEY, ServerProcess, tiny_gguf

from server_helpers import TOK, ScriptedRunner, make_engine

SYSTEM = [{"role": "system", "content": "You are a weather agent. Call get_weather(city)."},
          {"role": "user", "content": "Weather in Paris?"}]
TOOL = [{"role": "tool", "content": '{"city": "Paris", "temp": 21}'}]
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def open_session(client, **body):
    r = client.post("/v1/sessions", json=body or {"messages": SYSTEM})
    assert r.status_code == 200, r.text
    return r.json()


def generate(client, sid, **body):
    r = client.post(f"/v1/sessions/{sid}/generate", json={**GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def info(client, sid):
    return client.get(f"/v1/sessions/{sid}").json()


def blocks_used(client):
    return client.app.state.kog.engine.stats()["kv"]["blocks_used"]


def test_turns_equal_stateless_chat_and_compute_only_the_appended_tokens(client):
    opened = open_session(client)
    assert opened["object"] == "session" and opened["prefill_tokens_computed"] == opened["num_tokens"] - 1
    first = generate(client, opened["id"])
    stateless = client.post("/v1/chat/completions", json={"model": "kog", "messages": SYSTEM, **GREEDY}).json()
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["message"]["content"] == stateless["choices"][0]["message"]["content"]
    assert first["usage"]["prompt_tokens"] == opened["num_tokens"]
    context = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    before = info(client, opened["id"])["token_ids"]
    assert len(before) == context

    n = client.post(f"/v1/sessions/{opened['id']}/append", json={"messages": TOOL}).json()["num_tokens"]
    after = info(client, opened["id"])["token_ids"]
    # NOTE: the render may re-tokenize the model's own last tokens (it stopped before <|im_end|>):
    # the session then rolled back to the first difference, and those few tokens are recomputed.
    kept = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(before))
    assert kept > len(before) - 8 and len(after) == n
    second = generate(client, opened["id"])
    usage = second["usage"]
    appended = n - kept
    assert usage["prefill_tokens_computed"] == appended + 1  # the tool result + the pending last token
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - usage["prefill_tokens_computed"]
    conversation = SYSTEM + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}] + TOOL
    stateless = client.post("/v1/chat/completions", json={"model": "kog", "messages": conversation, **GREEDY}).json()
    assert second["choices"][0]["message"]["content"] == stateless["choices"][0]["message"]["content"]
    assert stateless["usage"]["prompt_tokens"] == n
    got = info(client, opened["id"])
    assert got["chat_mode"] and got["messages"][-1]["role"] == "assistant" and not got["busy"]
    assert client.delete(f"/v1/sessions/{opened['id']}").json()["deleted"] is True
    assert blocks_used(client) == 0


def test_streamed_generation_has_session_usage_and_joins_the_context(client):
    sid = open_session(client)["id"]
    r = client.post(f"/v1/sessions/{sid}/generate",
                    json={**GREEDY, "stream": True, "stream_options": {"include_usage": True}})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert usage["prefill_tokens_computed"] == 1 and usage["completion_tokens"] == 8
    assert info(client, sid)["num_tokens"] == usage["prompt_tokens"] + 8
    assert info(client, sid)["messages"][-1]["role"] == "assistant"


def test_fork_generate_in_branches_rollback_suspend_and_delete(client):
    sid = open_session(client, prompt_token_ids=list(range(5, 40)))["id"]
    generate(client, sid)
    client.post(f"/v1/sessions/{sid}/append", json={"token_ids": [7, 8, 9]})
    n = info(client, sid)["num_tokens"]
    ids = client.post(f"/v1/sessions/{sid}/fork", json={"n": 2}).json()["ids"]
    assert len(ids) == 2 and all(info(client, c)["num_tokens"] == n for c in ids)
    outs = [generate(client, c, temperature=1.0, seed=i) for i, c in enumerate(ids)]
    assert all(o["usage"]["prefill_tokens_computed"] == 1 for o in outs)  # the append was prefilled once
    assert info(client, sid)["num_tokens"] == n  # branches do not touch the parent
    r = client.post(f"/v1/sessions/{ids[0]}/rollback", json={"num_tokens": 10})
    assert r.json() == {"num_tokens": 10} and not info(client, ids[0])["chat_mode"]
    assert client.post(f"/v1/sessions/{sid}/suspend", json={}).json() == {"state": "suspended"}
    assert generate(client, sid)["usage"]["prompt_tokens"] == n  # a suspended session resumes
    for s in [sid, *ids]:
        assert client.delete(f"/v1/sessions/{s}").json()["deleted"] is True
    assert client.delete(f"/v1/sessions/{sid}").json()["deleted"] is False  # idempotent
    for method, path in [("get", ""), ("post", "/generate"), ("post", "/append"), ("post", "/fork")]:
        r = getattr(client, method)(f"/v1/sessions/{sid}{path}", **({"json": {}} if method == "post" else {}))
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert blocks_used(client) == 0


@pytest.mark.parametrize("path,body", [
    ("", {}), ("", {"messages": SYSTEM, "prompt_token_ids": [1, 2]}), ("", {"prompt_token_ids": [10**9]}),
    ("/append", {}), ("/append", {"messages": TOOL}), ("/rollback", {"num_tokens": 0}),
    ("/rollback", {"num_tokens": 10**6}), ("/generate", {"n": 2}), ("/fork", {"n": 0}),
])
def test_bad_input_is_400(client, path, body):
    sid = open_session(client, prompt_token_ids=[5, 6, 7])["id"]
    url = "/v1/sessions" if path == "" else f"/v1/sessions/{sid}{path}"
    r = client.post(url, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_sessions_need_the_api_key_and_are_in_the_schema(make_client):
    client = make_client(api_key="k")
    assert client.post("/v1/sessions", json={"messages": SYSTEM}).status_code == 401
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/sessions", "/v1/sessions/{session_id}", "/v1/sessions/{session_id}/generate",
            "/v1/sessions/{session_id}/append", "/v1/sessions/{session_id}/fork", "/v1/sessions/{session_id}/suspend",
            "/v1/sessions/{session_id}/rollback"} <= set(paths)


def test_a_second_generation_on_a_busy_session_is_409(make_client):
    client = make_client(make_engine(step_delay=0.02))
    sid = open_session(client)["id"]
    with client.stream("POST", f"/v1/sessions/{sid}/generate",
                       json={**GREEDY, "max_tokens": 100, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        busy = client.post(f"/v1/sessions/{sid}/generate", json=GREEDY)
        assert busy.status_code == 409 and busy.json()["error"]["type"] == "conflict_error"
        assert client.post(f"/v1/sessions/{sid}/append", json={"token_ids": [5]}).status_code == 409
    client.delete(f"/v1/sessions/{sid}")


def test_append_takes_the_whole_conversation_and_adds_only_the_new_messages(client):
    sids = [open_session(client)["id"] for _ in range(3)]
    replies = [generate(client, sid)["choices"][0]["message"] for sid in sids]
    client.post(f"/v1/sessions/{sids[0]}/append", json={"messages": TOOL})  # only the new message
    whole = SYSTEM + [replies[1]] + TOOL  # the conversation as the client holds it
    r = client.post(f"/v1/sessions/{sids[1]}/append", json={"messages": whole})
    assert r.status_code == 200, r.text
    from_get = info(client, sids[2])["messages"] + TOOL  # the server's copy of it
    assert client.post(f"/v1/sessions/{sids[2]}/append", json={"messages": from_get}).status_code == 200
    assert info(client, sids[1])["token_ids"] == info(client, sids[0])["token_ids"] == info(client, sids[2])["token_ids"]
    assert info(client, sids[1])["messages"] == info(client, sids[0])["messages"]
    assert r.json()["num_tokens"] == info(client, sids[0])["num_tokens"]


@pytest.mark.parametrize("messages,status,code", [
    ([SYSTEM[0], {"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": "x"}] + TOOL,
     409, "conversation_diverged"),  # the same first message, then a different one
    ([{"role": "system", "content": "You are a chef."}] + SYSTEM[1:] + TOOL, 409, "conversation_diverged"),
    (SYSTEM, 409, "conversation_diverged"),  # shorter than the session's conversation
    ("session", 400, None),  # the session's own conversation: nothing new
])
def test_append_of_a_conversation_that_diverges_is_409_and_changes_nothing(client, messages, status, code):
    sid = open_session(client)["id"]
    generate(client, sid)
    before = info(client, sid)
    if messages == "session":
        messages = before["messages"]
    r = client.post(f"/v1/sessions/{sid}/append", json={"messages": messages})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["param"] == "messages"
    assert info(client, sid) == before


def test_append_matches_a_tool_call_reply_in_the_form_the_api_returned_it(make_client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    client = make_client(make_engine(ScriptedRunner(TOK.encode(call), TOK.eos_token_id)))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    sids = [open_session(client, messages=SYSTEM, tools=tools)["id"] for _ in range(2)]
    replies = [generate(client, sid, max_tokens=64, ignore_eos=False)["choices"][0] for sid in sids]
    assert replies[0]["finish_reason"] == "tool_calls" and replies[0]["message"]["content"] is None
    reply = replies[1]["message"]
    args = json.loads(reply["tool_calls"][0]["function"]["arguments"])
    reply["tool_calls"][0]["function"]["arguments"] = json.dumps(dict(reversed(args.items())))  # same JSON
    tool = [{"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": '{"temp": 21}'}]
    client.post(f"/v1/sessions/{sids[0]}/append", json={"messages": tool})
    r = client.post(f"/v1/sessions/{sids[1]}/append", json={"messages": SYSTEM + [reply] + tool})
    assert r.status_code == 200, r.text
    assert info(client, sids[1])["token_ids"] == info(client, sids[0])["token_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_deleting_a_session_ends_its_generation_in_flight(make_client, stream):
    client = make_client(make_engine(FakeRunner(TOK.vocab_size, 256, 4), step_delay=0.02))
    sid = open_session(client)["id"]
    answer = {}

    def run():  # at 20 ms a step, 400 tokens take 8 s or more: ending sooner means it was cut
        answer["r"] = client.post(f"/v1/sessions/{sid}/generate",
                                  json={**GREEDY, "max_tokens": 400, "stream": stream})

    worker = threading.Thread(target=run)
    worker.start()
    engine = client.app.state.kog.engine
    _wait_for(lambda: info(client, sid)["busy"] and engine.stats()["running"] == 1)
    assert client.delete(f"/v1/sessions/{sid}").json() == {"id": sid, "object": "session", "deleted": True}
    worker.join(timeout=3)
    assert not worker.is_alive(), "the generation's client was left waiting"
    r = answer["r"]
    if stream:
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e[6:])["choices"]]
        assert "abort" in finishes and "length" not in finishes
    else:
        assert r.status_code == 409
        error = r.json()["error"]
        assert error["type"] == "conflict_error"
    assert error["code"] == "session_closed" and sid in error["message"]
    assert blocks_used(client) == 0 and engine.stats()["in_flight"] == 0
    metrics = client.get("/metrics").text
    assert 'kog_requests_total{finish_reason="abort"} 1.0' in metrics
    assert 'finish_reason="length"' not in metrics
    assert client.get(f"/v1/sessions/{sid}").status_code == 404
    again = open_session(client)["id"]  # the server keeps serving
    assert generate(client, again)["choices"][0]["finish_reason"] == "length"


def test_closing_the_engine_closes_every_session(make_client):
    client = make_client()
    sid = open_session(client)["id"]
    generate(client, sid)
    engine = client.app.state.kog.engine
    assert len(engine.engine.sessions) == 1 and blocks_used(client) > 0
    engine.close(drain=True, timeout=10)
    assert len(engine.engine.sessions) == 0
    kv = engine.engine.kv.stats()
    assert kv["blocks_used"] == 0 and kv["blocks_pinned"] == 0


def test_disconnect_mid_stream_leaves_the_context_over_a_real_server(tmp_path):
    srv = ServerProcess(tiny_gguf(tmp_path), "--api-key", API_KEY)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with httpx.Client(base_url=srv.url, headers=auth, timeout=60) as c:
            sid = c.post("/v1/sessions", json={"messages": SYSTEM}).json()["id"]
            first = c.post(f"/v1/sessions/{sid}/generate", json=GREEDY).json()
            before = c.get(f"/v1/sessions/{sid}").json()
            assert before["num_tokens"] == first["usage"]["total_tokens"]
            aborted = _ended(srv, "abort")
            # As long as the context allows: the native loop decodes a tiny model's tokens fast, and
            # 150 of them could all be out before the server saw the client leave (a CI flake).
            longest = 1024 - before["num_tokens"] - 8
            with c.stream("POST", f"/v1/sessions/{sid}/generate",
                          json={"max_tokens": longest, "ignore_eos": True, "stream": True}) as r:
                assert next(r.iter_lines()).startswith("data: ")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _ended(srv, "abort") == aborted:
                time.sleep(0.05)
            after = c.get(f"/v1/sessions/{sid}").json()
            assert _ended(srv, "abort") == aborted + 1 and not after["busy"]
            assert after["num_tokens"] == before["num_tokens"] and after["messages"] == before["messages"]
            again = c.post(f"/v1/sessions/{sid}/generate", json=GREEDY).json()
            assert again["usage"]["prefill_tokens_computed"] == 1  # the context's KV survived the abort
            assert c.delete(f"/v1/sessions/{sid}").json()["deleted"]
            assert srv.metric("kog_kv_blocks_used") == 0
    finally:
        srv.stop()


def _wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _ended(server, reason):
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(f'kog_requests_total{{finish_reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
