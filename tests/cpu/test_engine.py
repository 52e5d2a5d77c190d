"""The engine and scheduler against an oracle, with a fake model that reads its context back
through the paged KV cache (kog.testing.fake_runner): KV bookkeeping errors change the output."""

import pytest
import torch

import kog
from kog.engine import EngineConfig, LLMEngine
from kog.sampling_params import SamplingParams
from kog.testing.engine_oracle import oracle_tokens
from kog.testing.fake_runner import FakeRunner
from kog.testing.tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id


def make_engine(num_blocks=64, block_size=4, budget=16, max_num_seqs=8, max_model_len=256, host_blocks=0):
    runner = FakeRunner(TOK.vocab_size, num_blocks, block_size, host_blocks)
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_host_blocks=host_blocks)
    return LLMEngine(runner, TOK, [EOS], max_model_len, cfg), runner


def oracle(prompt, params, index=0):
    """Token ids the engine must produce: the same sampler on the true context."""
    return oracle_tokens(prompt, params, TOK.vocab_size, EOS, index)


def run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    deltas = {}
    steps = 0
    while engine.has_unfinished():
        for d in engine.step():
            deltas.setdefault((d.request_id, d.index), []).append(d.text)
        steps += 1
        assert steps < 5000, "engine made no progress"
    return {rid: engine.get_output(rid) for rid, _, _ in requests}, deltas


def prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TOK.vocab_size, (n,), generator=g).tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_single_request_matches_oracle_and_streams_its_text():
    engine, runner = make_engine()
    p = prompt(0, 11)
    outs, deltas = run(engine, [("a", p, GREEDY)])
    out = outs["a"].outputs[0]
    assert out.token_ids == oracle(p, GREEDY)
    assert out.finish_reason == "length" and outs["a"].finished
    assert "".join(deltas[("a", 0)]) == out.text == TOK.decode(out.token_ids)
    assert runner.calls["decode"] == 23  # first token from prefill, then one per decode step


def test_concurrent_requests_with_shared_prefixes_and_chunked_prefill():
    engine, runner = make_engine(budget=8)
    system = prompt(1, 13)
    reqs = [(f"r{i}", system + prompt(100 + i, 3 + 2 * i), SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True))
            for i in range(8)]
    outs, _ = run(engine, reqs)
    for rid, p, params in reqs:
        assert outs[rid].outputs[0].token_ids == oracle(p, params), rid
    assert engine.kv.stats()["blocks_used"] == 0  # nothing leaked; cached blocks may stay


def test_prefix_cache_reuse_is_reported_and_correct():
    engine, _ = make_engine()
    system = prompt(2, 17)
    first, _ = run(engine, [("a", system + [5, 6], GREEDY)])
    second, _ = run(engine, [("b", system + [7, 8, 9], GREEDY)])
    assert first["a"].num_cached_tokens == 0 and first["a"].prefill_tokens_computed == 19
    assert second["b"].num_cached_tokens == 16  # 4 full blocks of the shared system prompt
    assert second["b"].prefill_tokens_computed == 20 - 16
    assert second["b"].outputs[0].token_ids == oracle(system + [7, 8, 9], GREEDY)


@pytest.mark.parametrize("budget", [8, 64])  # the prefix takes several steps, or fits in one
def test_a_shared_prefix_arriving_at_once_is_computed_once(budget):
    # Running prefills take the budget first, so a later arrival is admitted only once the
    # prefix's blocks are appended (registered) ahead of it: it hits them, never recomputes them.
    engine, _ = make_engine(budget=budget)
    system = prompt(4, 24)  # 6 full blocks
    reqs = [(f"r{i}", system + prompt(200 + i, 5), GREEDY) for i in range(4)]
    outs, _ = run(engine, reqs)
    for rid, p, params in reqs:
        assert outs[rid].outputs[0].token_ids == oracle(p, params), rid
    assert [outs[f"r{i}"].num_cached_tokens for i in range(4)] == [0, 24, 24, 24]
    assert sum(o.prefill_tokens_computed for o in outs.values()) == engine.num_prefill_tokens_computed == 24 + 4 * 5


def test_identical_prompt_recomputes_only_the_last_block():
    engine, _ = make_engine()
    p = prompt(3, 16)
    run(engine, [("a", p, GREEDY)])
    again, _ = run(engine, [("b", p, GREEDY)])
    assert again["b"].num_cached_tokens == 12 and again["b"].prefill_tokens_computed == 4
    assert again["b"].outputs[0].token_ids == oracle(p, GREEDY)


def test_n_completions_fork_the_prompt_kv_copy_on_write():
    engine, runner = make_engine()
    p = prompt(4, 10)  # not block-aligned: the shared tail block is copied on first write
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    outs, _ = run(engine, [("a", p, params)])
    got = outs["a"].outputs
    assert [o.index for o in got] == [0, 1, 2]
    for o in got:
        assert o.token_ids == oracle(p, params, index=o.index)
    assert len({tuple(o.token_ids) for o in got}) > 1
    assert engine.kv.stats()["cow_copies"] >= 2
    assert outs["a"].prefill_tokens_computed == 10  # the prompt was prefilled once


def test_preemption_under_kv_pressure_loses_nothing():
    engine, _ = make_engine(num_blocks=12, block_size=4, budget=32, max_num_seqs=8)
    reqs = [(f"r{i}", prompt(200 + i, 6), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)) for i in range(4)]
    outs, _ = run(engine, reqs)
    for rid, p, params in reqs:
        assert outs[rid].outputs[0].token_ids == oracle(p, params), rid
    assert sum(o.prefill_tokens_computed for o in outs.values()) > 4 * 6  # someone was recomputed
    assert engine.kv.stats()["blocks_used"] == 0


def test_stop_strings_cut_the_text_and_streaming_holds_back_partial_matches():
    p = prompt(5, 9)
    full = TOK.decode(oracle(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    for include in (False, True):
        engine, _ = make_engine()
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        outs, deltas = run(engine, [("a", p, params)])
        out = outs["a"].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (cut + stop if include else cut)
        assert "".join(deltas[("a", 0)]) == out.text


def test_stop_token_ids_min_tokens_and_eos():
    p = prompt(6, 7)
    ref = oracle(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine, _ = make_engine()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[ref[3]])
    outs, _ = run(engine, [("a", p, params)])
    first = ref.index(ref[3])
    assert outs["a"].outputs[0].token_ids == ref[: first + 1]
    assert outs["a"].outputs[0].stop_reason == ref[3]


def test_max_model_len_ends_with_length():
    engine, _ = make_engine(max_model_len=20)
    outs, _ = run(engine, [("a", prompt(7, 15), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))])
    assert len(outs["a"].outputs[0].token_ids) == 5 and outs["a"].outputs[0].finish_reason == "length"


def test_abort_frees_kv_at_once():
    engine, _ = make_engine()
    engine.add_request("a", prompt(8, 30), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.kv.stats()["blocks_used"] > 0
    engine.abort("a")
    assert engine.kv.stats()["blocks_used"] == 0
    assert not engine.has_unfinished()
    assert engine.get_output("a").outputs[0].finish_reason == "abort"


@pytest.mark.parametrize(
    "ids, match",
    [([], "empty"), (list(range(3, 300)), r"297 tokens but the context length is 256"), ([1, 10**6], r"\[0, 400\)")],
)
def test_bad_prompts_are_rejected_before_queueing(ids, match):
    engine, _ = make_engine()
    with pytest.raises(kog.InvalidRequest, match=match):
        engine.add_request("x", ids, GREEDY)
    assert not engine.has_unfinished()


def test_logprobs_reported_per_token():
    engine, _ = make_engine()
    p = prompt(9, 5)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs, _ = run(engine, [("a", p, params)])
    out = outs["a"].outputs[0]
    assert len(out.logprobs) == 4
    for t, entry in zip(out.token_ids, out.logprobs):
        assert next(iter(entry)) == t and len(entry) in (3, 4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))
