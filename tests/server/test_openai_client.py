"""The official `openai` client against a real `kog serve` subprocess (loopback, tiny model):
chat and completions, streamed and not, n > 1, prompt scoring (echo + logprobs), tools, errors,
prefix-cache hits, disconnects, SIGTERM drain."""

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from kog.testing.reference_model import reference_logits
from kog.testing.server_process import API_KEY, ServerProcess, tiny_gguf
from kog.testing.tiny_models import random_weights, tiny_config

SYSTEM = "You are a helpful assistant. " * 6  # > 2 KV blocks of 16 tokens: a cacheable prefix
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tiny_gguf(tmp_path_factory.mktemp("model")), "--api-key", API_KEY, "--max-num-seqs", "8")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def messages(user="What is the weather in Paris?"):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_whole_and_streamed_agree(client):
    whole = client.chat.completions.create(model="tiny", messages=messages(), max_tokens=10, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="tiny", messages=messages(), max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_cached_tokens_rise_on_a_repeated_prefix(client):
    first = client.chat.completions.create(model="tiny", messages=messages("first question"), max_tokens=2)
    second = client.chat.completions.create(model="tiny", messages=messages("second question"), max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens - 1


def test_completions_n_and_stream(client):
    out = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6, n=3, seed=5)
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens <= 18
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6, n=2, seed=5,
                                            stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_logprobs_through_the_client(client):
    out = client.chat.completions.create(model="tiny", messages=messages(), max_tokens=3, logprobs=True,
                                         top_logprobs=2, temperature=0)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


def test_prompt_scoring_through_the_client_matches_the_reference_forward(client):
    config = tiny_config("llama")
    ids = list(range(40, 60))
    want = torch.log_softmax(reference_logits(config, random_weights(config), ids), dim=-1)  # tiny_gguf's weights
    scored = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and scored.usage.completion_tokens == 0
    assert lp.token_logprobs[1:] == pytest.approx([float(want[p - 1, ids[p]]) for p in range(1, len(ids))], abs=1e-4)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 0})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert [e and e[str(ids[p])]["logprob"] for p, e in enumerate(entries)] == [None] + lp.token_logprobs[1:]


def test_tools_request_shape(client):
    out = client.chat.completions.create(model="tiny", messages=messages(), tools=TOOLS, tool_choice="auto",
                                         max_tokens=8, response_format={"type": "json_object"})
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history = messages() + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "22 C, sunny"}]
    follow_up = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert follow_up.choices[0].message.role == "assistant"


def test_errors_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=messages(), temperature=5)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x " * 1200, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages())
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{server.url}/v1/completions", content=b"x" * (9 * 2**20),
                   headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_client_disconnect_mid_stream_frees_kv(server):
    # NOTE: n = 32 > --max-num-seqs: with 4 the decode loop (16 tokens per native call) could finish
    # all 200 tokens of the tiny model before the first chunk is read
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 200, "n": 32, "ignore_eos": True,
            "stream": True}
    aborted_before = _requests_ended(server, "abort")
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metric("kog_kv_blocks_used") > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.metric("kog_kv_blocks_used") > 0:
        time.sleep(0.05)
    assert server.metric("kog_kv_blocks_used") == 0 and server.metric("kog_num_requests_running") == 0
    assert _requests_ended(server, "abort") == aborted_before + 1  # aborted, not run to its end


def test_client_timeout_on_a_whole_response_aborts_it(server):
    # 8 waves of 8 sequences x 1000 tokens (the server runs 8 at a time): ~8000 dependent steps, far
    # more than 0.15 s even on an idle machine (200 tokens x 32 finished within 0.15 s once the
    # native decode loop ran 16 steps per call)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 1000, "n": 64, "ignore_eos": True}
    aborted_before = _requests_ended(server, "abort")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=0.15)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _requests_ended(server, "abort") == aborted_before:
        time.sleep(0.05)
    assert _requests_ended(server, "abort") == aborted_before + 1
    assert server.metric("kog_kv_blocks_used") == 0


def _requests_ended(server, reason):
    text = httpx.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        if line.startswith(f'kog_requests_total{{finish_reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigterm_drains_in_flight_then_exits(tmp_path_factory):
    srv = ServerProcess(tiny_gguf(tmp_path_factory.mktemp("model2")))
    try:
        result = {}

        def stream():
            # n > max_num_seqs: four waves, so the drain outlasts the checks below even on an idle machine
            # (steps run one token at a time while choices wait; the last wave runs the decode loop)
            body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 200, "n": 64, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
                result["events"] = [line for line in r.iter_lines() if line]

        t = threading.Thread(target=stream)
        t.start()
        while srv.metric("kog_num_requests_running") == 0:
            time.sleep(0.02)
        srv.terminate()
        time.sleep(0.1)
        refused = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        health = httpx.get(f"{srv.url}/health")
        t.join(60)
        assert srv.proc.wait(60) == 0
    finally:
        out = srv.stop()
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable", out
    assert health.status_code == 503 and health.json()["status"] == "draining"
    events = result["events"]
    assert events[-1] == "data: [DONE]"
    finishes = [ch["finish_reason"] for e in events[:-1] for ch in json.loads(e[6:])["choices"] if ch["finish_reason"]]
    assert finishes == ["length"] * 64  # every in-flight choice ran to its end
