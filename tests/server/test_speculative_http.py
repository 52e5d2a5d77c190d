"""The `speculative` body field (Kog extension) and the server default (`kog serve --speculative`):
greedy output is token for token the same with n-gram or draft-model speculation; `null` turns
the default off; a malformed value, or "draft" without a draft model, is a 400 before any token."""

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

import kog
from kog.engine import AsyncEngine
from kog.server import ServerConfig, build_app
from kog.speculation import SpeculativeParams
from kog.testing.fake_runner import FakeRunner, context_logits
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

from server_helpers import TOK, make_engine

NGRAM = {"method": "ngram", "num_tokens": 4}
# a repetitive prompt: n-gram drafts have something to copy
PROMPT = TOK.encode("the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.")


class CopyingRunner(FakeRunner):
    """Mostly continues the latest earlier occurrence of its last token (an induction head), so
    n-gram drafts are often right and sometimes wrong."""

    def logits(self, context):
        x = context_logits(context, self.vocab_size)
        hits = [j for j in range(len(context) - 1) if context[j] == context[-1]]
        if hits and hash(tuple(context)) % 4:
            x[context[hits[-1] + 1]] += 12.0
        return x


def copying_client(make_client, **config):
    return make_client(make_engine(CopyingRunner(TOK.vocab_size, 256, 4), max_model_len=1024), **config)


def complete(client, **body):
    r = client.post("/v1/completions", json={"model": "kog", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                             "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def drafted(client):
    return client.app.state.kog.engine.engine.speculator.stats["drafted"]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_ngram_speculation_gives_the_same_text(make_client, k):
    client = copying_client(make_client)
    plain = complete(client)
    assert drafted(client) == 0
    assert complete(client, speculative={"method": "ngram", "num_tokens": k}) == plain
    assert drafted(client) > 0
    chat = {"model": "kog", "messages": [{"role": "user", "content": "the quick brown fox the quick brown"}],
            "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    free = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    fast = client.post("/v1/chat/completions", json={**chat, "speculative": NGRAM, "stream": True}).text
    assert "".join(_contents(fast)) == free


def test_server_default_applies_unless_the_request_says_null(make_client):
    client = copying_client(make_client, speculative=SpeculativeParams("ngram", 4))
    plain = complete(client, speculative=None)
    assert drafted(client) == 0  # null: off, whatever the default
    assert complete(client) == plain and drafted(client) > 0  # absent: the default


MALFORMED = [{"method": "medusa"}, {"num_tokens": 0}, {"num_tokens": 17}, {"num_tokens": "4"}, {"num_tokens": 2.5},
             {"num_tokens": True}, {"method": "ngram", "k": 4}, "ngram", 4, {"ngram_min": 3, "ngram_max": 2}]


@pytest.mark.parametrize("value", MALFORMED, ids=str)
def test_malformed_speculative_is_a_400(client, value):
    for path, body in [("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})]:
        r = client.post(path, json={"model": "kog", "speculative": value, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("speculative")
    assert client.app.state.kog.engine.stats()["kv"]["blocks_used"] == 0


def test_draft_without_a_draft_model_is_a_400(client):
    sid = client.post("/v1/sessions", json={"prompt_token_ids": PROMPT}).json()["id"]
    for path, body in [("/v1/completions", {"model": "kog", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "kog", "messages": [{"role": "user", "content": "hi"}]}),
                       (f"/v1/sessions/{sid}/generate", {})]:
        for stream in (False, True):
            r = client.post(path, json={**body, "stream": stream, "speculative": {"method": "draft"}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
            assert "draft model" in r.json()["error"]["message"] and "--speculative-model" in r.json()["error"]["message"]
    assert client.app.state.kog.engine.engine._requests == {}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    """A tiny random-weight model that drafts for itself (every draft token accepted)."""
    config = tiny_config("llama")
    path = write_hf_model(tmp_path_factory.mktemp("tiny"), config, random_weights(config, seed=3))
    return kog.LLM(path, speculative_model=path, max_num_seqs=2, kv_cache_gib=0.01)


def test_greedy_draft_model_speculation_gives_the_same_tokens(tiny_llm):
    engine = AsyncEngine(tiny_llm.engine)
    try:
        with TestClient(build_app(engine, tiny_llm.tokenizer, None, ServerConfig(served_model_names=["kog"]))) as c:
            prompt = np.random.default_rng(0).integers(3, TOK.vocab_size, 12).tolist()
            body = {"model": "kog", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            plain = c.post("/v1/completions", json=body).json()
            fast = c.post("/v1/completions", json={**body, "speculative": {"method": "draft", "num_tokens": 3}}).json()
            assert fast["choices"][0]["text"] == plain["choices"][0]["text"]
            assert fast["usage"] == plain["usage"]
            assert tiny_llm.engine.speculator.stats["drafted"] > 0
    finally:
        engine.close(timeout=10)


def _contents(sse_text):
    """The content deltas of a chat SSE stream, in order."""
    chunks = [json.loads(e[6:]) for e in sse_text.split("\n\n") if e and e != "data: [DONE]"]
    return [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
