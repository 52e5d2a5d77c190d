"""Grammar masks computed on a worker thread while the step's forwards run
(kog.engine.structured.prefetch_masks): the outputs are token for token those of computing them
after the forwards, the decode rows' masks do come from the worker, and a failing forward still
waits for the worker before the step returns."""

import threading
import time

import pytest

from kog.engine import EngineConfig, LLMEngine, structured
from kog.sampling_params import SamplingParams
from kog.structured_output import grammar
from kog.testing.fake_runner import FakeRunner
from kog.testing.tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "maxLength": 6}}, "required": ["x"]}}}]


def make_engine():
    runner = FakeRunner(TOK.vocab_size, 256, block_size=4)
    return LLMEngine(runner, TOK, [EOS], 512, EngineConfig(max_num_seqs=8, max_num_batched_tokens=32))


def requests():
    """Greedy and sampled, n > 1, jump-forward on and off, n-gram speculation, tool calls."""
    out = []
    for i in range(6):
        structured_ = {"json_schema": PERSON, "jump_forward": i % 2 == 0} if i < 4 else \
            {"tools": TOOLS, "tool_choice": "required"}
        params = SamplingParams(max_tokens=80, temperature=0 if i % 3 == 0 else 1.0, seed=i, n=2 if i == 1 else 1,
                                structured=structured_, speculative={"method": "ngram"} if i == 3 else None)
        out.append((f"r{i}", TOK.encode(f"request {i}: a person"), params))
    return out


def run(engine):
    for rid, ids, params in requests():
        engine.add_request(rid, ids, params)
    for _ in range(3000):
        if not engine.has_unfinished():
            break
        engine.step()
    return {rid: [c.token_ids for c in engine.get_output(rid).outputs] for rid, _, _ in requests()}


def test_outputs_equal_masks_computed_after_the_forwards(monkeypatch):
    prefetched = run(make_engine())
    monkeypatch.setattr(structured, "prefetch_masks", lambda seqs: structured.MaskPrefetch(None))
    assert run(make_engine()) == prefetched
    assert all(all(ids for ids in outs) for outs in prefetched.values())


def test_decode_masks_come_from_the_worker_thread(monkeypatch):
    computed_on: list[str] = []  # the thread of each batch_allowed call that had masks to compute
    real = grammar.batch_allowed

    def spy(constraints):
        if any(c._allowed is None for c in constraints):
            computed_on.append(threading.current_thread().name)
        return real(constraints)

    monkeypatch.setattr(grammar, "batch_allowed", spy)
    run(make_engine())
    on_worker = sum(name.startswith("kog-grammar-masks") for name in computed_on)
    assert on_worker > 10 and on_worker > len(computed_on) - on_worker


def test_a_failing_forward_waits_for_the_worker(monkeypatch):
    engine = make_engine()
    engine.add_request("a", TOK.encode("a person"), SamplingParams(max_tokens=20, structured={"json_schema": PERSON}))
    engine.step()  # the prompt: its token sampled, the next step decodes
    finished = []

    def slow(constraints):
        time.sleep(0.2)
        finished.append(True)

    def broken_decode(*args):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(grammar, "batch_allowed", slow)
    monkeypatch.setattr(engine.runner, "decode", broken_decode)
    with pytest.raises(RuntimeError, match="decode failed"):
        engine.step()
    assert finished == [True]
