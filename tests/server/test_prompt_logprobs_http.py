"""/v1/completions `echo` (+ `logprobs`, + `max_tokens: 0`) and vLLM's `prompt_logprobs`, in process
over the fake model, whose logits after a context are known exactly (context_logits)."""

import json

import pytest
import torch

from kog.testing.fake_runner import context_logits

from server_helpers import TOK

PROMPT = "the quick brown fox jumps"
IDS = TOK.encode(PROMPT)


def complete(client, **body):
    return client.post("/v1/completions", json={"model": "kog", "prompt": PROMPT, **body})


def expected_logprob(p: int) -> float:
    """The fake model's log-probability of prompt token p after the tokens before it."""
    return float(torch.log_softmax(context_logits(IDS[:p], TOK.vocab_size), dim=-1)[IDS[p]])


def expected_top(p: int, k: int) -> list[int]:
    return torch.topk(context_logits(IDS[:p], TOK.vocab_size), k).indices.tolist()


def test_echo_with_logprobs_puts_the_prompt_tokens_first(client):
    plain = complete(client, max_tokens=3, temperature=0, logprobs=2).json()["choices"][0]
    body = complete(client, max_tokens=3, temperature=0, logprobs=2, echo=True).json()
    choice, lp = body["choices"][0], body["choices"][0]["logprobs"]
    assert choice["text"] == PROMPT + plain["text"]
    n = len(IDS)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 3
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        assert lp["token_logprobs"][p] == pytest.approx(expected_logprob(p), abs=1e-5)
        best = float(torch.log_softmax(context_logits(IDS[:p], TOK.vocab_size), dim=-1).max())
        assert 1 <= len(lp["top_logprobs"][p]) <= 2  # NOTE: two tokens of the same text show as one
        assert max(lp["top_logprobs"][p].values()) == pytest.approx(best, abs=1e-5)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 3


def test_echo_without_logprobs_and_echo_of_the_prompt_alone(client):
    body = complete(client, max_tokens=2, temperature=0, echo=True).json()
    assert body["choices"][0]["text"].startswith(PROMPT) and body["choices"][0]["logprobs"] is None
    alone = complete(client, max_tokens=0, echo=True, logprobs=0).json()
    choice = alone["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(IDS) and choice["logprobs"]["top_logprobs"][1] is None
    assert alone["usage"]["completion_tokens"] == 0 and alone["usage"]["prompt_tokens"] == len(IDS)
    err = complete(client, max_tokens=0)
    assert err.status_code == 400 and err.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_vllm_format(client):
    body = complete(client, max_tokens=1, prompt_logprobs=2).json()
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(IDS) and entries[0] is None
    for p in range(1, len(IDS)):
        assert next(iter(entries[p])) == str(IDS[p])  # the prompt's token first
        assert entries[p][str(IDS[p])]["logprob"] == pytest.approx(expected_logprob(p), abs=1e-5)
        assert set(entries[p]) == {str(t) for t in expected_top(p, 2)} | {str(IDS[p])}
        assert entries[p][str(IDS[p])]["decoded_token"] == TOK.decode([IDS[p]], skip_special_tokens=False)
    assert complete(client, max_tokens=1).json()["choices"][0]["prompt_logprobs"] is None
    assert complete(client, max_tokens=1, prompt_logprobs=21).status_code == 400


def test_cached_prompt_is_recomputed_for_its_logprobs(client):
    first = complete(client, max_tokens=1, temperature=0).json()
    again = complete(client, max_tokens=1, temperature=0).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prefix is cached...
    scored = complete(client, max_tokens=0, echo=True, logprobs=1).json()  # ...yet every position is scored
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    lps = scored["choices"][0]["logprobs"]["token_logprobs"]
    assert lps[1:] == pytest.approx([expected_logprob(p) for p in range(1, len(IDS))], abs=1e-5)
    assert first["choices"][0]["text"] == again["choices"][0]["text"]


def test_streamed_echo_with_logprobs_equals_the_whole_response(client):
    body = dict(max_tokens=4, temperature=0, logprobs=1, echo=True, n=2, prompt_logprobs=1)
    whole = complete(client, **body).json()["choices"]
    events = [e for e in complete(client, stream=True, **body).text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):])["choices"][0] for e in events[:-1]]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["text"] == PROMPT and mine[0]["prompt_logprobs"] == whole[index]["prompt_logprobs"]
        assert "".join(c["text"] for c in mine) == whole[index]["text"]
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
        assert tokens == whole[index]["logprobs"]["token_logprobs"]
        offsets = [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert offsets[len(IDS)] == len(PROMPT)


def test_streamed_echo_of_the_prompt_alone(client):
    r = complete(client, max_tokens=0, echo=True, logprobs=1, stream=True, stream_options={"include_usage": True})
    chunks = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPT and choices[-1]["finish_reason"] == "length"
    assert len(choices[0]["logprobs"]["tokens"]) == len(IDS) and chunks[-1]["usage"]["completion_tokens"] == 0
