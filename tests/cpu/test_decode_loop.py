"""The multi-token decode loop (kog.engine.decode_loop) on a tiny random model on the CPU: tokens
equal a step at a time, stops end exactly where they should, streaming and abort still work."""

import numpy as np
import pytest
import torch

from kog import _C
from kog.engine import EngineConfig, LLMEngine
from kog.engine.decode_loop import shifted_seed
from kog.loader import LoadedModel
from kog.models import ModelRunner
from kog.sampling_params import SamplingParams
from kog.testing.tiny_models import random_weights, tiny_config, tiny_tokenizer

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
V = TOK.vocab_size


@pytest.fixture(scope="module")
def model():
    config = tiny_config("llama", max_position_embeddings=512)
    return LoadedModel(path=None, config=config, weights=random_weights(config, seed=5), dtype=torch.float32,
                       tokenizer=TOK, chat_template=None, stop_token_ids=())


class Recorder:
    """Wraps an engine's DecodeLoop.run, recording each call's k."""

    def __init__(self, engine):
        self.ks = []
        inner = engine.decode_loop.run

        def run(seqs, k):
            self.ks.append(k)
            return inner(seqs, k)

        engine.decode_loop.run = run


def make_engine(model, max_steps, num_blocks=96, block_size=4):
    runner = ModelRunner(model, num_kv_blocks=num_blocks, block_size=block_size)
    engine = LLMEngine(runner, TOK, [EOS], 512, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256))
    engine.decode_loop.max_steps = max_steps
    return engine, Recorder(engine)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, V, 5 + 3 * i).tolist() for i in range(n)]


def generate(engine, requests):
    """Runs requests [(prompt, params)] to the end; returns (token ids per (request, index),
    streamed token ids per (request, index), streamed text per (request, index))."""
    for i, (p, params) in enumerate(requests):
        engine.add_request(f"r{i}", p, params)
    streamed, texts = {}, {}
    while engine.has_unfinished():
        for d in engine.step():
            streamed.setdefault((d.request_id, d.index), []).extend(d.token_ids)
            texts[(d.request_id, d.index)] = texts.get((d.request_id, d.index), "") + d.text
    outs = {}
    for i in range(len(requests)):
        for o in engine.get_output(f"r{i}").outputs:
            outs[(f"r{i}", o.index)] = (o.token_ids, o.text, o.finish_reason)
    return outs, streamed, texts


def assert_no_kv_held(engine):
    """Every block the loop reserved was given back: only the prefix cache keeps blocks."""
    st = engine.kv.stats()
    assert st["num_sequences"] == 0 and st["blocks_free"] + st["blocks_cached"] == st["num_blocks"], st


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    "temperature": SamplingParams(temperature=0.9, seed=11, max_tokens=40, ignore_eos=True),
    "filters": SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.02, seed=12, max_tokens=37),
    "penalties": SamplingParams(temperature=0.8, seed=13, repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.3, max_tokens=40, ignore_eos=True),
    "greedy_penalties": SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4,
                                       max_tokens=33, ignore_eos=True),
    "min_tokens": SamplingParams(temperature=1.0, seed=14, min_tokens=20, max_tokens=40),
    "n2": SamplingParams(n=2, temperature=1.0, seed=15, max_tokens=30, ignore_eos=True),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_loop_tokens_equal_one_step_tokens(model, name):
    reqs = [(p, PARAMS[name]) for p in prompts(3)]
    loop, rec = make_engine(model, max_steps=16)
    one, one_rec = make_engine(model, max_steps=1)
    got, streamed, texts = generate(loop, reqs)
    want, _, _ = generate(one, reqs)
    assert got == want
    assert not one_rec.ks and max(rec.ks) >= 8  # the loop ran (K = 16 once 16 tokens are out)
    for key, (ids, text, _) in got.items():  # streaming delivered every token and all the text
        assert streamed[key] == ids and texts[key] == text
    assert_no_kv_held(loop)


def test_a_batch_with_different_max_tokens_ends_each_row_mid_loop(model):
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for p, m in zip(prompts(4, seed=1), (9, 23, 17, 40))]
    loop, rec = make_engine(model, max_steps=8)
    one, _ = make_engine(model, max_steps=1)
    got, _, _ = generate(loop, reqs)
    want, _, _ = generate(one, reqs)
    assert got == want
    assert [len(got[(f"r{i}", 0)][0]) for i in range(4)] == [9, 23, 17, 40]
    assert 8 in rec.ks


def test_a_stop_token_mid_loop_ends_exactly_there(model):
    p = prompts(1, seed=2)[0]
    base = SamplingParams(temperature=0.7, seed=21, max_tokens=60, ignore_eos=True)
    one, _ = make_engine(model, max_steps=1)
    ref = generate(one, [(p, base)])[0][("r0", 0)][0]
    # a token whose first occurrence is past the first loop calls (K = 1, 2, 4 cover 7 tokens)
    j = next(i for i in range(10, len(ref)) if ref[i] not in ref[:i])
    stop = SamplingParams(temperature=0.7, seed=21, max_tokens=60, ignore_eos=True, stop_token_ids=[ref[j]])
    loop, rec = make_engine(model, max_steps=16)
    ids, _, reason = generate(loop, [(p, stop)])[0][("r0", 0)]
    assert ids == ref[: j + 1] and reason == "stop"
    assert max(rec.ks) >= 4
    assert_no_kv_held(loop)


def test_eos_mid_loop_respects_min_tokens(model):
    # EOS is the stop id; pick it as the token the greedy run produces, to make it reachable
    p = prompts(1, seed=3)[0]
    one, _ = make_engine(model, max_steps=1)
    ref = generate(one, [(p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))])[0][("r0", 0)][0]
    j = next(i for i in range(12, len(ref)) if ref[i] not in ref[:i])
    params = SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[ref[j]], min_tokens=j + 1)
    loop, _ = make_engine(model, max_steps=16)
    one2, _ = make_engine(model, max_steps=1)
    got = generate(loop, [(p, params)])[0]
    assert got == generate(one2, [(p, params)])[0]
    assert len(got[("r0", 0)][0]) > j + 1  # the stop id was banned at index j (min_tokens)


def test_stop_string_mid_loop_matches_one_step(model):
    p = prompts(1, seed=4)[0]
    one, _ = make_engine(model, max_steps=1)
    _, text, _ = generate(one, [(p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))])[0][("r0", 0)]
    assert len(text) > 30
    stop = text[25:28]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop=[stop])
    loop, rec = make_engine(model, max_steps=16)
    one2, _ = make_engine(model, max_steps=1)
    got = generate(loop, [(p, params)])[0]
    assert got == generate(one2, [(p, params)])[0]
    assert got[("r0", 0)][2] == "stop" and max(rec.ks) >= 4
    assert_no_kv_held(loop)


def test_abort_between_loop_calls_frees_the_kv_and_keeps_the_others(model):
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)) for p in prompts(2, seed=5)]
    loop, rec = make_engine(model, max_steps=8)
    one, _ = make_engine(model, max_steps=1)
    for i, (p, params) in enumerate(reqs):
        loop.add_request(f"r{i}", p, params)
    while not rec.ks or rec.ks[-1] < 4:
        loop.step()
    loop.abort("r0")
    out = loop.get_output("r0")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while loop.has_unfinished():
        loop.step()
    want, _, _ = generate(one, reqs)
    assert loop.get_output("r1").outputs[0].token_ids == want[("r1", 0)][0]
    assert out.outputs[0].token_ids == want[("r0", 0)][0][: len(out.outputs[0].token_ids)]
    loop.release("r0")
    loop.release("r1")
    assert_no_kv_held(loop)


def test_a_waiting_request_stops_the_loop_growing(model):
    loop, rec = make_engine(model, max_steps=16)
    loop.add_request("a", prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while not rec.ks or rec.ks[-1] < 4:
        loop.step()
    n_calls = len(rec.ks)
    loop.add_request("b", prompts(1, seed=9)[0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    loop.step()  # b waits for admission: a one-step step admits it
    assert len(rec.ks) == n_calls
    assert loop.get_output("b").outputs[0].token_ids  # b's first token came in that step


def test_shifted_seed_moves_the_draw_counter():
    for seed in (0, 5, (1 << 64) - 1, 123456789):
        for offset in (0, 1, 7, 1000):
            for c in (0, 1, 3):
                assert _C.uniform01(shifted_seed(seed, offset), c) == _C.uniform01(seed, c + offset)


def test_a_session_keeps_exactly_its_context_kv_after_a_loop_stopped_mid_call(model):
    """A session's sequence keeps its KV when a request ends: the loop's unused reservation must
    be given back, or the next generation on the session would read a wrong cache."""
    p = prompts(1, seed=6)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    one, _ = make_engine(model, max_steps=1)
    ref = generate(one, [(p, greedy)])[0][("r0", 0)][0]
    j = next(i for i in range(10, len(ref)) if ref[i] not in ref[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, stop_token_ids=[ref[j]])

    def run_session(engine):
        engine.sessions.open("s", p)
        while engine.has_unfinished():
            engine.step()
        for turn, params in enumerate((stop, greedy)):
            engine.sessions.generate("s", f"g{turn}", params)
            while engine.has_unfinished():
                engine.step()
            engine.sessions.append("s", [5, 6, 7])
        info = engine.sessions.info("s")
        return [engine.get_output(f"g{t}").outputs[0].token_ids for t in range(2)], info

    loop, rec = make_engine(model, max_steps=16)
    one2, _ = make_engine(model, max_steps=1)
    got, info = run_session(loop)
    assert (got, info) == run_session(one2)
    assert got[0] == ref[: j + 1] and max(rec.ks) >= 4
    assert loop.kv.num_tokens(0) == info["num_computed"]  # nothing reserved is left


def test_an_unseeded_request_draws_a_seed_at_admission(model):
    """No seed: one is drawn from torch's generator when the sequence is first sampled, so
    torch.manual_seed makes a run repeatable and different seeds give different tokens."""
    p = prompts(1, seed=7)[0]
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)

    def tokens(torch_seed):
        torch.manual_seed(torch_seed)
        engine, rec = make_engine(model, max_steps=16)
        out = generate(engine, [(p, params)])[0][("r0", 0)][0]
        assert max(rec.ks) >= 8
        return out

    assert tokens(0) == tokens(0)
    assert tokens(0) != tokens(1)


def test_parameters_below_float32_range_sample_like_their_limit(model):
    """top_p = 5e-324 is valid (> 0) but 0 in float32: it keeps the most likely token only, and
    must not fail the step (the native sampler refuses top_p = 0)."""
    p = prompts(1, seed=8)[0]
    tiny = SamplingParams(temperature=1.0, top_p=5e-324, seed=1, max_tokens=20, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine, rec = make_engine(model, max_steps=16)
    got = generate(engine, [(p, tiny)])[0]
    assert got[("r0", 0)][0] == generate(make_engine(model, max_steps=1)[0], [(p, greedy)])[0][("r0", 0)][0]
    assert max(rec.ks) >= 8


def test_loop_decoded_blocks_feed_the_prefix_cache_like_one_step(model):
    """The loop reserves KV count-only; settling a row names its tokens, so a retry whose
    prompt is the first request's prompt + output reuses the loop-decoded blocks."""
    p = prompts(1, seed=7)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    def hit_tokens_of_the_retry(engine):
        out = generate(engine, [(p, greedy)])[0][("r0", 0)][0]
        before = engine.kv.stats()["prefix_hit_tokens"]
        engine.add_request("retry", p + out, SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        return engine.kv.stats()["prefix_hit_tokens"] - before

    loop, rec = make_engine(model, max_steps=16)
    one, _ = make_engine(model, max_steps=1)
    hit = hit_tokens_of_the_retry(loop)
    assert max(rec.ks) >= 8
    assert hit == hit_tokens_of_the_retry(one) and hit >= (len(p) + 60 - 1) // 4 * 4 - 4
    assert_no_kv_held(loop)


def test_integer_parameters_past_int32_sample_like_their_limit(model):
    """top_k, min_tokens and stop ids beyond int32 are valid requests (found by the API fuzzer as
    an HTTP 500): top_k >= vocab is top-k off, min_tokens past every reachable length bans the
    stop ids to the end, and a stop id the vocabulary lacks never comes, exactly as their
    in-range equivalents do."""
    p = prompts(1, seed=9)[0]
    huge = SamplingParams(temperature=0.7, top_k=355687428095999, min_tokens=1 << 40, max_tokens=1 << 41, seed=3,
                          stop_token_ids=[1 << 40, V + 5])
    plain = SamplingParams(temperature=0.7, top_k=0, min_tokens=12, max_tokens=12, seed=3)
    for steps in (1, 16):
        engine, _ = make_engine(model, max_steps=steps)
        engine.add_request("r0", p, huge)
        for _ in range(12):
            engine.step()
        got = engine.get_output("r0").outputs[0].token_ids[:12]
        engine.abort("r0")
        want = generate(make_engine(model, max_steps=steps)[0], [(p, plain)])[0][("r0", 0)][0]
        assert got == want
