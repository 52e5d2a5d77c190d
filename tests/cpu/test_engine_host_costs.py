"""The engine's per-step host work does not grow with the context: one token list per sequence,
incremental penalty counts, one batched allocator call and one native block-table fill per
decode step, outputs that share the prompt. Each test checks the mechanism (calls, identities,
exact values), not a timing (bench/engine_overhead.py measures those)."""

import torch

from kog.engine import EngineConfig, LLMEngine
from kog.engine.outputs import FinishReason
from kog.engine.sequence import Sequence, TokenSpan
from kog.sampler import PenaltyCounts, SampleRow, apply_penalties, make_generator, sample
from kog.sampling_params import SamplingParams
from kog.testing.engine_oracle import oracle_tokens
from kog.testing.fake_runner import FakeRunner, context_logits
from kog.testing.tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id


class CountingKV:
    """Wraps the engine's KVCacheManager and counts the calls of each method."""

    def __init__(self, kv) -> None:
        self.kv, self.calls = kv, {}

    def __getattr__(self, name):
        attr = getattr(self.kv, name)
        if not callable(attr):
            return attr

        def counted(*args, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kw)
        return counted

    def __contains__(self, seq_id):
        return seq_id in self.kv


def make_engine(num_blocks=256, budget=64, max_num_seqs=8):
    runner = FakeRunner(TOK.vocab_size, num_blocks, 4)
    engine = LLMEngine(runner, TOK, [EOS], 1024, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget))
    spy = CountingKV(engine.kv)
    engine.kv = engine.scheduler.kv = spy
    return engine, spy


def prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TOK.vocab_size, (n,), generator=g).tolist()


def test_a_decode_step_makes_one_allocator_append_and_one_block_table_fill():
    engine, spy = make_engine()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"r{i}", prompt(i, 9 + 3 * i), params)
    while not all(engine.get_output(f"r{i}").outputs and engine.get_output(f"r{i}").outputs[0].token_ids
                  for i in range(5)):
        engine.step()  # prefill: every request has its first token
    decode_steps = 0
    while engine.has_unfinished():
        spy.calls.clear()
        engine.step()
        decode_steps += 1
        assert spy.calls.get("append_batch") == 1, spy.calls
        assert "append" not in spy.calls and "block_table" not in spy.calls, spy.calls
        assert spy.calls.get("block_tables") == 1, spy.calls
    assert decode_steps == 11


def test_decode_under_pressure_preempts_as_one_by_one_appends_did_and_matches_the_oracle():
    """A pool too small for every sequence: the batched append preempts the latest sequence
    and the outputs still equal the oracle's."""
    runner = FakeRunner(TOK.vocab_size, 14, 4)
    engine = LLMEngine(runner, TOK, [EOS], 1024, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=14, ignore_eos=True, repetition_penalty=1.3)
    prompts = {f"r{i}": prompt(10 + i, 7) for i in range(4)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    preempted = 0
    while engine.has_unfinished():
        waiting = len(engine.scheduler.waiting)
        engine.step()
        preempted += len(engine.scheduler.waiting) > waiting
    assert preempted and engine.num_prefill_tokens_computed > sum(map(len, prompts.values()))
    for rid, p in prompts.items():
        out = oracle_tokens(p, params, TOK.vocab_size, EOS)
        assert engine.get_output(rid).outputs[0].token_ids == out, rid
        assert engine.get_output(rid).outputs[0].finish_reason is FinishReason.LENGTH


def test_one_token_list_per_sequence_grows_in_place():
    engine, _ = make_engine()
    p = prompt(1, 13)
    engine.add_request("r", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seq = engine._requests["r"][0]
    tokens = seq.token_ids
    assert not hasattr(seq, "all_ids")
    while engine.has_unfinished():
        engine.step()
        assert seq.token_ids is tokens  # appended in place, never rebuilt
    assert tokens[:13] == p and seq.prompt_ids == p and seq.output_ids == tokens[13:]
    assert len(seq.output_ids) == seq.num_output_tokens == 6


def test_outputs_share_the_prompt_list_and_snapshot_the_tokens():
    engine, _ = make_engine()
    p = prompt(2, 20)
    engine.add_request("r", p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    first = engine.get_output("r")
    engine.step()
    second = engine.get_output("r")
    assert first.prompt_token_ids is second.prompt_token_ids and first.prompt_token_ids == p
    assert len(first.outputs[0].token_ids) + 1 == len(second.outputs[0].token_ids)  # earlier snapshot unchanged
    assert engine.is_finished("r") is False
    while engine.has_unfinished():
        engine.step()
    assert engine.is_finished("r") and engine.get_output("r").finished


def test_token_span_is_a_read_only_view():
    ids = [5, 6, 7, 8]
    span = TokenSpan(ids, 1, 3)
    assert len(span) == 2 and list(span) == [6, 7] and span[-1] == 7 and span[0:1] == [6]
    live = TokenSpan(ids, 2)
    ids.append(9)
    assert live == [7, 8, 9] and span == [6, 7] and span != [6, 7, 8]


def test_penalty_counts_equal_recounting_the_context_at_every_step():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    for params in (SamplingParams(repetition_penalty=1.7),
                   SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
                   SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5)):
        seq = Sequence(0, "r", 0, torch.randint(0, vocab, (30,), generator=g).tolist(), params, None)
        counts = PenaltyCounts()
        for step in range(25):
            logits = torch.randn(vocab, generator=g)
            counts.sync(seq.prompt_ids, seq.output_ids, vocab)
            got = counts.apply(logits, params)
            want = apply_penalties(logits, SampleRow(params, list(seq.prompt_ids), list(seq.output_ids)))
            assert torch.equal(got, want), (params, step)
            for _ in range(step % 3):  # 0-2 tokens per step (jump-forward appends several)
                seq.append_token(int(torch.randint(0, vocab, (1,), generator=g)))


def test_the_engine_keeps_penalty_counts_per_sequence():
    engine, _ = make_engine()
    # logprobs: sampled by kog.sampler (a native request's counts are native: kog.engine.decode_loop)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, frequency_penalty=0.5, logprobs=0)
    engine.add_request("r", prompt(3, 8), params)
    seq = engine._requests["r"][0]
    while engine.has_unfinished():
        engine.step()
    assert seq.penalties is not None and seq.penalties.num_output == 3  # synced before each of the 3 later draws
    assert float(seq.penalties.counts.sum()) == 3
    engine.add_request("plain", prompt(4, 8), SamplingParams(temperature=0, max_tokens=2))
    assert engine._requests["plain"][0].penalties is None
    engine.add_request("native", prompt(5, 8), SamplingParams(temperature=0, max_tokens=2, frequency_penalty=0.5))
    assert engine._requests["native"][0].penalties is None
