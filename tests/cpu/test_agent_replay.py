"""bench/agent_replay.py's driver over the fake model: both modes finish every turn with the
same outputs, and sessions compute far fewer prefill tokens (keeps the benchmark honest)."""

import argparse
import importlib.util
import sys
from pathlib import Path

from kog.engine import EngineConfig, LLMEngine
from kog.llm import LLM
from kog.loader import ChatTemplate
from kog.testing.fake_runner import FakeRunner
from kog.testing.tiny_models import CHATML_TEMPLATE, tiny_tokenizer

TOK = tiny_tokenizer()
spec = importlib.util.spec_from_file_location("agent_replay", Path(__file__).parents[2] / "bench" / "agent_replay.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["agent_replay"] = bench  # dataclasses look their module up
spec.loader.exec_module(bench)
sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import agent_trace  # noqa: E402  (bench/agent_trace.py, the --trace workload)


def replay(sessions):
    runner = FakeRunner(TOK.vocab_size, 512, 4)
    engine = LLMEngine(runner, TOK, [TOK.eos_token_id], 4096,
                       EngineConfig(max_num_batched_tokens=64, enable_prefix_caching=sessions))
    llm = LLM.from_engine(engine, TOK, ChatTemplate(CHATML_TEMPLATE))
    args = argparse.Namespace(agents=3, turns=3, system_tokens=120, fork_turns="1", seed=0)
    system, agents = bench.build_workload(llm, args)
    for ag in agents:
        for t in ag.turns:
            t.wait_s = 0.01
    driver = bench.Driver(engine, system, agents, sessions)
    driver.run()
    assert engine.kv.stats()["blocks_used"] == 0 and not engine.has_unfinished()
    assert len(driver.ttft) == 9
    return driver.prefill_tokens, [o for ag in agents for o in ag.outputs]


def test_sessions_and_stateless_replays_agree_and_sessions_prefill_less():
    tokens_a, outs_a = replay(sessions=True)
    tokens_b, outs_b = replay(sessions=False)
    assert outs_a == outs_b
    assert tokens_a < tokens_b / 2


def test_trace_replay_sessions_beat_stateless_with_and_without_prefix_caching():
    """A tiny --trace configuration: >= 30 turns with a fork, a pool that evicts waiting
    agents; sessions recompute least, and every mode produces the same turn outputs."""
    system, probe = agent_trace.build_trace(TOK.vocab_size, agents=2, turns=30, scale=0.01)
    longest = max(agent_trace.final_context(system, ag) for ag in probe)
    assert sum(t.fork for t in probe[0].turns) == 1 and len(probe[0].turns) == 30
    results = []
    for _, sessions, cache in agent_trace.MODES:
        runner = FakeRunner(TOK.vocab_size, int(1.5 * longest) // 4 + 2, 4, num_host_blocks=2 * (longest // 4 + 2))
        _, agents = agent_trace.build_trace(TOK.vocab_size, agents=2, turns=30, scale=0.01)
        for ag in agents:
            for t in ag.turns:
                t.wait_s = 0.001
        results.append(agent_trace.replay_mode(runner, TOK, system, agents, sessions, cache, longest + 64, 64))
    (_, a, _, outs_a), (_, b, _, outs_b), (_, c, _, outs_c) = results
    assert outs_a == outs_b == outs_c
    assert a < b < c
