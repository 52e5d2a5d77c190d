"""Every failure is an OpenAI error object with the right status: 400 (never FastAPI's 422),
401, 404, 413, 429 with Retry-After, 503 with Retry-After while draining, 500 when the engine fails."""

import asyncio
import json

import httpx
import pytest

from kog.engine import AsyncEngine
from kog.server import ServerConfig, build_app

from server_helpers import TEMPLATE, TOK, make_engine

MSGS = [{"role": "user", "content": "hello"}]


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0), ("top_logprobs", 21),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("top_k", -2), ("min_p", 2), ("stop", 3),
    ("messages", []), ("tool_choice", "sometimes"), ("response_format", {"type": "xml"}),
    ("response_format", {"type": "json_schema"}), ("tools", [{"type": "function", "function": {"name": "bad name!"}}]),
])
def test_invalid_chat_fields_are_400_naming_the_field(client, field, value):
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, field: value})
    err = assert_error(r, 400)
    assert err["type"] == "invalid_request_error" and err["param"].split(".")[0] == field


def test_engine_side_validation_is_400_with_param(client):
    r = client.post("/v1/completions", json={"model": "kog", "prompt": "hi", "max_tokens": 2, "min_tokens": 5})
    assert_error(r, 400, param="min_tokens")
    r = client.post("/v1/completions", json={"model": "kog", "prompt": [10**7], "max_tokens": 2})
    assert_error(r, 400)
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "top_logprobs": 2})
    assert_error(r, 400, param="top_logprobs")
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "tool_choice": "required"})
    assert_error(r, 400, param="tool_choice")


def test_integer_parameters_past_int32_are_served(client):
    """Valid but huge top_k / min_tokens / stop ids (the fuzzer's 500: the native sampler takes
    int32) run as their in-range equivalents: top-k off, EOS banned to max_tokens, a stop id no
    token has."""
    body = {"model": "kog", "messages": MSGS, "max_tokens": 4, "temperature": 0.5, "seed": 1}
    huge = body | {"top_k": 355687428095999, "min_tokens": 4, "stop_token_ids": [1 << 40]}
    r = client.post("/v1/chat/completions", json=huge)
    assert r.status_code == 200, r.text
    plain = client.post("/v1/chat/completions", json=body | {"min_tokens": 4})
    assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_malformed_bodies_are_400(client):
    assert_error(client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(client.post("/v1/chat/completions", json={"messages": MSGS}), 400, param="model")
    assert_error(client.post("/v1/completions", json={"model": "kog", "prompt": []}), 400, param="prompt")


def test_context_length_exceeded(client):
    r = client.post("/v1/completions", json={"model": "kog", "prompt": [5] * 600})
    assert_error(r, 400, code="context_length_exceeded")
    r = client.post("/v1/completions", json={"model": "kog", "prompt": [5] * 100, "max_tokens": 500})
    assert_error(r, 400, param="max_tokens", code="context_length_exceeded")


def test_unknown_model_and_path_are_404(client):
    assert_error(client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": MSGS}), 404, "model",
                 "model_not_found")
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)


def test_api_key(make_client):
    client = make_client(api_key="s3cret")
    assert_error(client.get("/v1/models"), 401, code="invalid_api_key")
    assert_error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(client.post("/v1/completions", json={"model": "kog", "prompt": "x"},
                             headers={"Authorization": "Basic s3cret"}), 401)
    ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "kog"
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_body_over_the_limit_is_413(make_client):
    client = make_client(max_body_bytes=1000)
    big = {"model": "kog", "messages": [{"role": "user", "content": "x" * 2000}]}
    assert_error(client.post("/v1/chat/completions", json=big), 413, code="request_too_large")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(30):
            yield b" " * 100

    assert_error(client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "max_tokens": 1}).status_code == 200


def run_async(app_kwargs, scenario):
    """Runs scenario(http, engine) against an app served in process by httpx's ASGI transport."""

    async def main():
        engine = AsyncEngine(app_kwargs.pop("engine"), max_waiting=app_kwargs.pop("max_waiting", 64))
        app = build_app(engine, TOK, TEMPLATE, ServerConfig(**app_kwargs))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kog") as http:
            try:
                return await scenario(http, engine)
            finally:
                await engine.shutdown(drain=False, timeout=10)

    return asyncio.run(asyncio.wait_for(main(), 60))


def completion(http, max_tokens=40, stream=False):
    return http.post("/v1/completions", json={"model": "kog", "prompt": "the quick brown fox", "max_tokens": max_tokens,
                                              "ignore_eos": True, "stream": stream})


def test_full_waiting_queue_is_429_with_retry_after():
    async def scenario(http, engine):
        async def until(running, waiting):
            while (engine.stats()["running"], engine.stats()["waiting"]) != (running, waiting):
                await asyncio.sleep(0.005)

        busy = [asyncio.ensure_future(completion(http))]
        await until(1, 0)
        busy.append(asyncio.ensure_future(completion(http)))  # max_num_seqs=1: this one waits
        await until(1, 1)
        refused = await completion(http, max_tokens=1)
        done = await asyncio.gather(*busy)
        return refused, done

    refused, done = run_async(dict(engine=make_engine(step_delay=0.01, max_num_seqs=1), max_waiting=1, retry_after_s=3),
                              scenario)
    assert_error(refused, 429)
    assert refused.headers["retry-after"] == "3"
    assert [r.status_code for r in done] == [200, 200]


def test_draining_refuses_new_requests_with_503_and_finishes_in_flight():
    async def scenario(http, engine):
        running = asyncio.ensure_future(completion(http, max_tokens=30, stream=True))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.01)
        shutdown = asyncio.ensure_future(engine.shutdown(drain=True))
        await asyncio.sleep(0.02)
        refused = await completion(http, max_tokens=1)
        health = await http.get("/health")
        finished = await running
        assert await shutdown
        return refused, health, finished

    refused, health, finished = run_async(dict(engine=make_engine(step_delay=0.01), retry_after_s=5), scenario)
    assert_error(refused, 503)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert refused.headers["retry-after"] == health.headers["retry-after"] == "5"  # clients retry elsewhere
    events = [json.loads(e[6:]) for e in finished.text.split("\n\n") if e.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(ch["text"]) > 0 for e in events for ch in e["choices"]) > 1


def test_engine_failure_is_500_and_an_error_event_mid_stream(make_client):
    engine = make_engine()
    real = engine.step
    state = {"fail": False}

    def step():
        if state["fail"]:
            raise RuntimeError("device lost")
        return real()

    engine.step = step
    client = make_client(engine)
    state["fail"] = True
    err = assert_error(client.post("/v1/completions", json={"model": "kog", "prompt": "hi"}), 500)
    assert "device lost" in err["message"] and err["type"] == "server_error"
    r = client.post("/v1/completions", json={"model": "kog", "prompt": "hi", "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert "device lost" in json.loads(events[-2][6:])["error"]["message"] and events[-1] == "data: [DONE]"
    state["fail"] = False
    assert client.post("/v1/completions", json={"model": "kog", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_dead_engine_turns_health_to_503(make_client):
    engine = make_engine()

    def broken(rid):
        raise RuntimeError("bookkeeping bug")

    engine.get_output = broken
    client = make_client(engine)
    assert_error(client.post("/v1/completions", json={"model": "kog", "prompt": "hi", "max_tokens": 2}), 500)
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "kog_engine_accepting 0.0" in client.get("/metrics").text
