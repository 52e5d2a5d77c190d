"""Speculative decoding through the engine (kog.engine.speculative): greedy output identical to
plain greedy (n-gram and draft model, with and without a grammar), sampled output distributed as
the target (chi-square), KV truncated back after every verify and freed at the end."""

import json

import numpy as np
import pytest
import torch

import kog
from kog.engine import EngineConfig, LLMEngine, chunks
from kog.loader import load_model
from kog.models import ModelRunner, PrefillChunk
from kog.sampler import filter_logits
from kog.sampling_params import SamplingParams
from kog.speculation.params import SpeculativeParams
from kog.structured_output.params import StructuredOutputParams
from kog.testing.fake_runner import FakeRunner, context_logits
from kog.testing.tiny_models import random_weights, tiny_config, tiny_tokenizer, write_hf_model

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
V = TOK.vocab_size


def chi2_999(dof: int) -> float:
    """The 0.999 quantile of chi-square with dof degrees of freedom (Wilson-Hilferty; within 1% for dof >= 3)."""
    z = 3.0902  # standard normal 0.999 quantile
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


class CopyingRunner(FakeRunner):
    """A fake model that mostly continues the latest earlier occurrence of its last token (an
    induction head), so n-gram drafts are often right and sometimes wrong."""

    def logits(self, context):
        x = context_logits(context, V)
        hits = [j for j in range(len(context) - 1) if context[j] == context[-1]]
        if hits and hash(tuple(context)) % 4:  # 3 contexts in 4 copy
            x[context[hits[-1] + 1]] += 12.0
        return x


def make_engine(runner_cls=CopyingRunner, num_blocks=512, budget=32, max_num_seqs=8):
    runner = runner_cls(V, num_blocks, block_size=4)
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return LLMEngine(runner, TOK, [EOS], 1024, cfg), runner


def run(engine, requests):
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    for _ in range(5000):
        if not engine.has_unfinished():
            return {rid: engine.get_output(rid) for rid, _, _ in requests}
        engine.step()
        # NOTE: between steps the allocator holds exactly the tokens with computed KV.
        for seqs in engine._requests.values():
            for s in seqs:
                if not s.is_finished and s.seq_id in engine.kv:
                    assert engine.kv.num_tokens(s.seq_id) == s.num_computed
    pytest.fail("engine made no progress")


def repetitive_prompt(seed, n=40):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, V, (n // 3,), generator=g).tolist()
    return base + base[: n // 3] + base[:5]


def outputs(engine, prompts, params):
    outs = run(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("k,native", [(1, True), (4, True), (4, False)])
def test_greedy_ngram_speculation_equals_plain_greedy_token_for_token(k, native, monkeypatch):
    if not native:  # verify chunks through runner.verify instead of the decode path
        monkeypatch.setattr(chunks, "MAX_CHUNK_TOKENS", 0)
    prompts = [repetitive_prompt(i) for i in range(10)]
    plain = outputs(make_engine()[0], prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine, runner = make_engine()
    fast = outputs(engine, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                   speculative=SpeculativeParams("ngram", k)))
    for a, b in zip(plain, fast):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text
    s = engine.speculator.stats
    assert (runner.calls["verify"] > 0) != native and 0 < s["accepted"] < s["drafted"]  # accepts and rejects
    assert sum(o.num_forward_passes for o in fast) < sum(o.num_forward_passes for o in plain)
    assert engine.kv.stats()["blocks_used"] == 0


def test_greedy_speculation_under_a_grammar_equals_plain_constrained_greedy():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["xy", "zw", "q"]},
                                                     "maxItems": 12}},
              "required": ["a"], "additionalProperties": False}
    prompts = [repetitive_prompt(20 + i) + TOK.encode('{"a": ["xy", "zw", "xy", "q"]}') for i in range(8)]

    def params(spec):
        return SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutputParams(json_schema=schema),
                              speculative=SpeculativeParams("ngram", 5) if spec else None)

    plain = outputs(make_engine()[0], prompts, params(False))
    engine, _ = make_engine()
    fast = outputs(engine, prompts, params(True))
    for a, b in zip(plain, fast):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        if a.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(b.outputs[0].text)["a"], list)
    assert engine.speculator.stats["accepted"] > 0
    assert engine.kv.stats()["blocks_used"] == 0


def test_greedy_speculation_keeps_the_tool_call_budget_check():
    """A tool call whose strings never end (the copying model repeats its context): under max_tokens
    the call is closed in time (kog.structured_output.call_budget), with speculation token for token as without:
    drafts stop at the first token that would leave no room, the target's token is checked."""
    search = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "lang": {"type": "string"}},
        "required": ["query", "lang"]}}}]
    prompts = [repetitive_prompt(40 + i) + TOK.encode('<tool_call>\n{"name": "search", "arguments": {"query": "')
               for i in range(6)]

    def params(spec):
        return SamplingParams(temperature=0, max_tokens=60, speculative=SpeculativeParams("ngram", 4) if spec else None,
                              structured=StructuredOutputParams(tools=search, tool_choice="required"))

    plain = outputs(make_engine()[0], prompts, params(False))
    engine, _ = make_engine()
    fast = outputs(engine, prompts, params(True))
    for a, b in zip(plain, fast):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        call = json.loads(b.outputs[0].text[len("<tool_call>\n"):b.outputs[0].text.index("\n</tool_call>")])
        assert set(call["arguments"]) >= {"query", "lang"}
    assert 0 < engine.speculator.stats["accepted"] < engine.speculator.stats["drafted"]
    assert engine.kv.stats()["blocks_used"] == 0


def test_sampled_speculation_keeps_the_target_distribution():
    """Token 2 of every request comes out of one verify (draft: what followed token 1 in the
    prompt); over many seeds its frequencies must match the target's filtered softmax."""
    x, y = 7, 9
    prompt = repetitive_prompt(3)[:20] + [x, y] + repetitive_prompt(4)[:10]

    class Runner(CopyingRunner):
        def logits(self, context):
            if context == prompt:  # the first token is always x
                out = torch.full((V,), -30.0)
                out[x] = 0.0
                return out
            if context == prompt + [x]:  # the draft y is likely, not certain: accepts and rejects
                out = context_logits(context, V)
                out[y] = out.max() + 0.5
                return out
            return super().logits(context)

    params = SamplingParams(temperature=1.3, top_k=5, max_tokens=3, ignore_eos=True,
                            speculative=SpeculativeParams("ngram", 1))
    engine, runner = make_engine(Runner, num_blocks=2048, max_num_seqs=32, budget=512)
    n = 400
    outs = run(engine, [(str(i), prompt, SamplingParams(**{**params.__dict__, "seed": i})) for i in range(n)])
    assert engine.speculator.stats["drafted"] == n  # the draft [y] each time
    seconds = [o.outputs[0].token_ids[1] for o in outs.values()]
    p = torch.softmax(filter_logits(Runner(V, 1).logits(prompt + [x]), params), -1)
    support = torch.nonzero(p > 0).flatten().tolist()
    assert set(seconds) <= set(support) and y in support
    counts = np.array([seconds.count(t) for t in support])
    expected = n * p[support].numpy()
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < chi2_999(len(support) - 1), (counts, expected)


def test_draft_model_speculation_needs_a_draft_model():
    engine, _ = make_engine()
    with pytest.raises(kog.InvalidRequest, match="draft model"):
        engine.add_request("a", [5, 6], SamplingParams(speculative={"method": "draft"}))


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    config = tiny_config("llama")
    folder = tmp_path_factory.mktemp("tiny")
    return {seed: write_hf_model(folder / str(seed), config, random_weights(config, seed=seed)) for seed in (3, 4)}


@pytest.fixture(scope="module")
def tiny(tiny_paths):
    return {seed: load_model(path) for seed, path in tiny_paths.items()}


@pytest.mark.parametrize("draft_seed", [3, 4])  # the target's own weights, other weights
def test_greedy_draft_model_speculation_equals_plain_greedy_on_a_tiny_model(tiny, draft_seed):
    target = tiny[3]
    prompts = [np.random.default_rng(i).integers(3, V, 10 + i).tolist() for i in range(8)]

    def engine():
        runner = ModelRunner(target, num_kv_blocks=64, block_size=16)
        return LLMEngine(runner, target.tokenizer, target.stop_token_ids, 256, EngineConfig(max_num_seqs=4))

    plain = outputs(engine(), prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    fast_engine = engine()
    fast_engine.speculator.use_draft_model(ModelRunner(tiny[draft_seed], num_kv_blocks=64, block_size=16), 4)
    fast = outputs(fast_engine, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                        speculative=SpeculativeParams("draft", 4)))
    for a, b in zip(plain, fast):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    s = fast_engine.speculator.stats
    if draft_seed == 3:
        assert s["accepted"] == s["drafted"] > 0
        assert all(o.num_forward_passes <= 6 for o in fast)  # prompt, then 5 tokens per verify
    assert fast_engine.kv.stats()["blocks_used"] == 0
    assert len(fast_engine.speculator.drafter._free) == 4  # every draft slab released


def test_llm_loads_a_speculative_model_and_keeps_greedy_output(tiny_paths):
    llm = kog.LLM(tiny_paths[3], speculative_model=tiny_paths[4], max_num_seqs=2, kv_cache_gib=0.01)
    prompts = [{"prompt_token_ids": np.random.default_rng(i).integers(3, V, 12).tolist()} for i in range(3)]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    fast = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                speculative={"method": "draft", "num_tokens": 3}))
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.speculator.stats["drafted"] > 0


def test_short_chunks_through_the_decode_path_equal_prefill(tiny):
    """engine/chunks.py: n decode rows sharing a block table compute the chunk's causal prefill."""
    def fresh():
        r = ModelRunner(tiny[3], num_kv_blocks=16, block_size=4)
        return r, [np.arange(i * 8, i * 8 + 8, dtype=np.int32) for i in range(2)]

    def chunk(table, tokens, start):
        pos = np.arange(start, start + len(tokens))
        return PrefillChunk(tokens, start, table, table[pos // 4].astype(np.int64) * 4 + pos % 4)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, V, n).tolist() for n in (9, 14)]
    runs = [rng.integers(3, V, n).tolist() for n in (5, 3)]
    out = []
    for native in (True, False):
        r, tables = fresh()
        r.prefill([chunk(t, p, 0) for t, p in zip(tables, prompts)])
        cs = [chunk(t, run, len(p)) for t, run, p in zip(tables, runs, prompts)]
        out.append(chunks.forward_chunks(r, cs, all_logits=True) if native else r.verify(cs))
        if native:  # the last rows equal the non-all_logits answer
            r2, t2 = fresh()
            r2.prefill([chunk(t, p, 0) for t, p in zip(t2, prompts)])
            last = chunks.forward_chunks(r2, [chunk(t, run, len(p)) for t, run, p in zip(t2, runs, prompts)])
            assert torch.allclose(last, torch.stack([x[-1] for x in out[0]]), atol=1e-6)
    for a, b in zip(*out):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_abort_mid_speculation_frees_kv_and_the_draft_slab(tiny):
    engine = LLMEngine(ModelRunner(tiny[3], num_kv_blocks=64, block_size=16), tiny[3].tokenizer,
                       tiny[3].stop_token_ids, 256, EngineConfig(max_num_seqs=2))
    engine.speculator.use_draft_model(ModelRunner(tiny[4], num_kv_blocks=64, block_size=16), 2)
    engine.add_request("a", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                                                                speculative={"method": "draft"}))
    for _ in range(3):
        engine.step()
    assert engine.speculator.stats["steps"] > 0 and len(engine.speculator.drafter._free) == 1
    engine.abort("a")
    assert engine.kv.stats()["blocks_used"] == 0 and len(engine.speculator.drafter._free) == 2
