"""SamplingParams(prompt_logprobs=N) on a tiny random model against a plain-torch forward:
chunked prefill, prefix-cache hits (recomputed), n > 1, batches mixing requests with and
without them, and the parameter's errors."""

import numpy as np
import pytest
import torch

import kog
from kog.testing.reference_model import reference_logits
from kog.testing.tiny_models import random_weights, tiny_config, write_hf_model

ATOL = 1e-4  # fp32 engine (paged, chunked, fused weights) vs the fp32/fp64 reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, weights, folder) of a llama whose LM head is scaled up: peaked distributions,
    so a logprob taken from the wrong row or token is far off."""
    config = tiny_config("llama")
    weights = random_weights(config, seed=5)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 40
    return config, weights, write_hf_model(tmp_path_factory.mktemp("tiny"), config, weights)


def make_llm(tiny, **kw):
    # 16-token steps: a 45-token prompt is prefilled in three chunks.
    return kog.LLM(str(tiny[2]), dtype="float32", max_num_batched_tokens=16, kv_cache_gib=0.02, **kw)


def prompt(config, n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, config.vocab_size, n)]


def assert_matches_reference(tiny, ids, prompt_lps, k):
    config, weights, _ = tiny
    lp = torch.log_softmax(reference_logits(config, weights, ids), dim=-1)  # [T, vocab]
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    for p in range(1, len(ids)):
        entry = prompt_lps[p]
        assert next(iter(entry)) == ids[p]  # the prompt's token first
        assert entry[ids[p]] == pytest.approx(float(lp[p - 1, ids[p]]), abs=ATOL), p
        top_vals, top_ids = torch.topk(lp[p - 1], k)
        assert set(entry) == set(top_ids.tolist()) | {ids[p]}, p
        for t, v in zip(top_ids.tolist(), top_vals.tolist()):
            assert entry[t] == pytest.approx(v, abs=ATOL)


def test_prompt_logprobs_match_the_reference_forward(tiny):
    llm = make_llm(tiny)
    ids = prompt(tiny[0], 45)
    out = llm.generate({"prompt_token_ids": ids}, kog.SamplingParams(prompt_logprobs=3, max_tokens=2, temperature=0))[0]
    assert_matches_reference(tiny, ids, out.prompt_logprobs, 3)
    zero = llm.generate({"prompt_token_ids": ids}, kog.SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    assert [list(e) for e in zero.prompt_logprobs[1:]] == [[t] for t in ids[1:]]
    plain = llm.generate({"prompt_token_ids": ids}, kog.SamplingParams(max_tokens=1))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens == 32  # their blocks were cached


def test_cached_prefix_is_recomputed_for_prompt_logprobs(tiny):
    llm = make_llm(tiny)
    ids = prompt(tiny[0], 45, seed=1)
    llm.generate({"prompt_token_ids": ids}, kog.SamplingParams(max_tokens=1))  # caches 2 full blocks
    warm = llm.generate({"prompt_token_ids": ids}, kog.SamplingParams(max_tokens=1))[0]
    assert warm.num_cached_tokens == 32
    out = llm.generate({"prompt_token_ids": ids}, kog.SamplingParams(prompt_logprobs=2, max_tokens=1))[0]
    assert out.num_cached_tokens == 0 and out.prefill_tokens_computed == len(ids)
    assert_matches_reference(tiny, ids, out.prompt_logprobs, 2)


def test_batches_mixing_requests_n_and_one_token_prompts(tiny):
    llm = make_llm(tiny)
    a, b = prompt(tiny[0], 30, seed=2), prompt(tiny[0], 20, seed=3)
    greedy = kog.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    alone = [llm.generate({"prompt_token_ids": p}, greedy)[0].outputs[0].token_ids for p in (a, b)]
    with_lps = kog.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1, n=2)
    outs = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}, {"prompt_token_ids": [7]}],
                        [with_lps, greedy, with_lps])
    assert_matches_reference(tiny, a, outs[0].prompt_logprobs, 1)
    assert [c.token_ids for c in outs[0].outputs] == [alone[0], alone[0]]
    assert outs[1].prompt_logprobs is None and outs[1].outputs[0].token_ids == alone[1]
    assert outs[2].prompt_logprobs == [None]


def test_prompt_logprobs_errors(tiny):
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(kog.InvalidRequest, match="prompt_logprobs"):
            kog.SamplingParams(prompt_logprobs=bad)
    llm = make_llm(tiny)
    with llm.session(prompt_token_ids=prompt(tiny[0], 10)) as s:
        with pytest.raises(kog.InvalidRequest, match="prompt_logprobs"):
            s.generate(kog.SamplingParams(prompt_logprobs=1))
        assert s.generate(kog.SamplingParams(max_tokens=2)).outputs[0].token_ids  # the session is intact
