"""/v1/completions, /v1/models, /health and /metrics in process over the fake model."""

import asyncio
import json
import re
import time

import pytest

import kog
from kog.llm import LLM
from kog.testing.fake_runner import FakeRunner

from server_helpers import TOK, make_engine


def complete(client, **body):
    return client.post("/v1/completions", json={"model": "kog", **body})


def test_prompt_forms_and_choice_indices(client):
    ids = TOK.encode("the quick brown fox")
    expected = LLM.from_engine(make_engine(), TOK).generate(
        {"prompt_token_ids": ids}, kog.SamplingParams(max_tokens=5, temperature=0))[0].outputs[0].text
    for prompt in ["the quick brown fox", ids]:
        body = complete(client, prompt=prompt, max_tokens=5, temperature=0).json()
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == expected
        assert body["usage"]["prompt_tokens"] == len(ids)
    body = complete(client, prompt=[ids, ids[:3]], max_tokens=3, n=2, seed=3).json()
    assert [c["index"] for c in sorted(body["choices"], key=lambda c: c["index"])] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == len(ids) + 3 and body["usage"]["completion_tokens"] <= 12
    echo = complete(client, prompt="the quick", max_tokens=2, echo=True, temperature=0).json()
    assert echo["choices"][0]["text"].startswith("the quick")


def test_default_max_tokens_is_16(client):
    body = complete(client, prompt="the", ignore_eos=True).json()
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


def test_stream_with_several_prompts_and_usage(client):
    r = complete(client, prompt=["the quick", "brown fox"], max_tokens=4, ignore_eos=True, stream=True,
                 stream_options={"include_usage": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    finishes = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_logprobs_completions_format(client):
    body = complete(client, prompt="the quick", max_tokens=4, temperature=0, logprobs=2).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(len(top) <= 2 and max(top.values()) == tok_lp for top, tok_lp in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_models_and_health(make_client):
    client = make_client(served_model_names=["smol", "kog"])
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["smol", "kog"] and models["data"][0]["max_model_len"] == 256  # 64 blocks x 4 tokens caps the context
    assert complete(client, model="kog", prompt="a", max_tokens=1).json()["model"] == "smol"
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def metric(text, name):
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1))


def test_metrics_count_tokens_and_latencies(client):
    usages = [complete(client, prompt="the quick brown fox jumps", max_tokens=5, ignore_eos=True).json()["usage"]
              for _ in range(3)]
    text = client.get("/metrics").text
    assert metric(text, "kog_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert metric(text, "kog_generation_tokens_total") == 15
    assert metric(text, "kog_time_to_first_token_seconds_count") == 3
    assert metric(text, "kog_e2e_request_latency_seconds_count") == 3
    assert metric(text, "kog_inter_token_latency_seconds_count") == 12
    assert metric(text, "kog_kv_blocks_used") == 0 and metric(text, "kog_num_requests_running") == 0
    assert metric(text, "kog_prefix_cache_hits_total") >= sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) > 0
    assert metric(text, "kog_prefix_cache_queries_total") >= metric(text, "kog_prefix_cache_hits_total")
    computed = sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert metric(text, "kog_prefill_tokens_computed_total") == computed < sum(u["prompt_tokens"] for u in usages)
    assert 'kog_requests_total{finish_reason="length"} 3.0' in text


def test_extra_routers_plug_in_with_state_and_auth():
    """How the sessions API will join: a router reading app.state.kog, guarded by the API key."""
    from fastapi import APIRouter, Depends, Request
    from fastapi.testclient import TestClient

    from kog.engine import AsyncEngine
    from kog.server import ServerConfig, build_app
    from kog.server.state import get_state, require_api_key

    from server_helpers import TEMPLATE

    router = APIRouter(dependencies=[Depends(require_api_key)])

    @router.get("/v1/sessions")
    async def sessions(request: Request) -> dict:
        return {"model": get_state(request).model_name, "running": get_state(request).engine.stats()["running"]}

    engine = AsyncEngine(make_engine())
    app = build_app(engine, TOK, TEMPLATE, ServerConfig(api_key="k"), routers=[router])
    try:
        client = TestClient(app)
        assert client.get("/v1/sessions").status_code == 401
        assert client.get("/v1/sessions", headers={"Authorization": "Bearer k"}).json() == {"model": "kog", "running": 0}
        assert "/v1/sessions" in client.get("/openapi.json").json()["paths"]
    finally:
        engine.close()


def counted_engine(step_delay=0.0, **config):
    """An engine over a large fake KV pool that records (running, waiting) after each step."""
    engine = make_engine(FakeRunner(TOK.vocab_size, 1024, 4), step_delay, **config)
    steps = []
    step = engine.step

    def counted():
        out = step()
        steps.append((len(engine.scheduler.running), len(engine.scheduler.waiting)))
        return out

    engine.step = counted
    return engine, steps


def distinct_prompts(n):
    return [[5 + i, 6 + i, 7 + i, 8 + i, 9 + i] for i in range(n)]


@pytest.mark.parametrize("n,first_step", [(12, (12, 0)), (24, (16, 8))])
def test_a_list_of_prompts_is_admitted_in_one_step(make_client, n, first_step):
    engine, steps = counted_engine(max_num_seqs=16)
    client = make_client(engine)
    body = complete(client, prompt=distinct_prompts(n), max_tokens=4, ignore_eos=True).json()
    assert len(body["choices"]) == n and body["usage"]["completion_tokens"] == 4 * n
    assert steps[0] == first_step  # every prompt was queued before the first step: it admits all that fit


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_a_list_of_prompts_aborts_every_one(make_client, stream):
    n = 40
    engine, steps = counted_engine(step_delay=0.01, max_num_seqs=16)
    client = make_client(engine)
    left_at: list[int] = []
    body = {"model": "kog", "prompt": distinct_prompts(n), "max_tokens": 200, "ignore_eos": True, "stream": stream}

    async def main():
        leave = asyncio.Event()
        loop = asyncio.get_running_loop()
        inner = engine.step

        def step_then_maybe_leave():
            out = inner()
            if len(steps) == 3:  # some prompts are running: the client goes away
                left_at.append(len(steps))
                loop.call_soon_threadsafe(leave.set)
            return out

        engine.step = step_then_maybe_leave
        return await call_asgi(client.app, "/v1/completions", body, leave)

    sent = asyncio.run(asyncio.wait_for(main(), 60))
    status = sent[0]["status"]
    assert status == (200 if stream else 499)
    stats = client.app.state.kog.engine.stats
    deadline = time.monotonic() + 10
    while stats()["in_flight"] or stats()["running"] or stats()["waiting"]:
        assert time.monotonic() < deadline, stats()
        time.sleep(0.01)
    assert stats()["kv"]["blocks_used"] == 0
    # Every prompt was queued at once, so the aborts land within a step or two of the client
    # leaving (one prompt per step would queue the other 37 first, a step each).
    assert len(steps) - left_at[0] <= 3, (len(steps), left_at)
    assert f'kog_requests_total{{finish_reason="abort"}} {float(n)}' in client.get("/metrics").text


async def call_asgi(app, path, body, leave: asyncio.Event) -> list[dict]:
    """POSTs body to the app as an ASGI server would; the client disconnects once `leave` is set.
    Returns the messages the app sent."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    pending = [{"type": "http.request", "body": data, "more_body": False}]
    sent = []

    async def receive():
        if pending:
            return pending.pop()
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent
