"""bench/agent_replay.py --trace: sessions shaped like real coding-agent traces, on a tiny
long-context model, against a stateless client with prefix caching on (vLLM's default) and off.

Trace shape (seeded, per agent): a shared system prompt with tool schemas (16k tokens at scale
1), a task (2k), then --turns turns; each turn the model writes ~1% of its context (a tool call
or an edit; greedy, ignore_eos, so the input:output ratio over the task is ~100:1), a tool runs
(a real wait of 20-200 ms) and returns 0.3k-2.3k tokens (a file read, a test log), so contexts
grow past 64k. One turn in the middle forks 3 branches (seeded sampling) and keeps the first.
--scale multiplies every token count (the default keeps a run of all three modes within a few
minutes on 2 CPU cores; --scale 1 is the full 64k+ shape, tens of minutes there).

Memory: the device KV pool holds 1.5 final contexts, the host swap pool all of them, so while
an agent waits on its tool the others' growth evicts its cached blocks (stateless) or swaps its
suspended session to the host pool (sessions).

The model: a Llama of 1 layer, hidden 32, 2 query heads over 1 KV head of 16 dims, random
weights, a position range past the longest context: prefill and decode cost what attention over
the context costs, with almost nothing else on top.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from agent_replay import Agent, Driver, Turn

from kog.engine import EngineConfig, LLMEngine

SYSTEM, TASK, RESULT_MIN, RESULT_MAX = 16_000, 2_000, 300, 2_300  # tokens at scale 1


def build_trace(vocab: int, agents: int, turns: int, scale: float, seed: int = 0) -> tuple[list[int], list[Agent]]:
    """The shared system prompt and each agent's task and turns (token ids in [3, vocab))."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(max(1, int(n * scale)))]  # noqa: E731
    system = ids(SYSTEM)
    fork_turn = turns // 2
    out = []
    for a in range(agents):
        task = ids(TASK)
        context = len(system) + len(task)
        trace = []
        for t in range(turns):
            written = max(2, context // 100)
            result = ids(rng.randint(RESULT_MIN, RESULT_MAX))
            trace.append(Turn(written, rng.uniform(0.02, 0.2), result, t == fork_turn))
            context += written + len(result)
        out.append(Agent(f"agent{a}", task, trace))
    return system, out


def final_context(system: list[int], agent: Agent) -> int:
    return len(system) + len(agent.task) + sum(t.max_tokens + len(t.result) for t in agent.turns)


def tiny_long_runner(max_context: int, num_blocks: int, num_host_blocks: int, block_size: int = 16):
    """(runner, tokenizer) of the tiny long-context model described in the module docstring."""
    from kog.loader import load_model
    from kog.models.runner import ModelRunner
    from kog.testing.tiny_models import tiny_config, write_hf_model

    config = tiny_config("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64,
                         max_position_embeddings=max_context + 1024)
    model = load_model(write_hf_model(Path(tempfile.mkdtemp(prefix="kog-trace-")) / "hf", config))
    runner = ModelRunner(model, num_kv_blocks=num_blocks, block_size=block_size, num_host_blocks=num_host_blocks)
    return runner, model.tokenizer


MODES = (("(a) Kog sessions", True, True),
         ("(b) stateless, prefix cache on", False, True),
         ("(c) stateless, prefix cache off", False, False))


def replay_mode(runner, tokenizer, system, agents, sessions: bool, cache: bool, max_len: int,
                batched_tokens: int = 4096) -> tuple[float, int, list[float], list]:
    """One mode on a fresh engine over `runner`: (wall s, prefill tokens, TTFTs, turn outputs)."""
    blocks = runner.kv.kv.shape[1]
    engine = LLMEngine(runner, tokenizer, [], max_len,
                       EngineConfig(max_num_seqs=8, max_num_batched_tokens=batched_tokens, max_model_len=max_len,
                                    num_host_blocks=runner.kv.host.shape[1], namespace="trace",
                                    enable_prefix_caching=cache))
    assert engine.kv.num_blocks == blocks
    driver = Driver(engine, system, agents, sessions)
    wall = driver.run()
    return wall, driver.prefill_tokens, driver.ttft, [o for ag in agents for o in ag.outputs]


def run_trace(args) -> None:
    """Builds the trace and the model, replays the three modes, prints the table."""
    import statistics

    system, probe = build_trace(400, args.agents, args.turns, args.scale, args.seed)
    longest = max(final_context(system, ag) for ag in probe)
    bs = 16
    device_blocks = int(1.5 * longest) // bs + 8
    host_blocks = args.agents * (longest // bs + 8)
    runner, tokenizer = tiny_long_runner(longest, device_blocks, host_blocks, bs)
    results = {}
    for name, sessions, cache in MODES:
        _, agents = build_trace(runner.vocab_size, args.agents, args.turns, args.scale, args.seed)
        results[name] = replay_mode(runner, tokenizer, system, agents, sessions, cache, longest + 512)
        print(f"# {name}: {results[name][0]:.1f} s, {results[name][1]} prefill tokens", flush=True)
    inputs = sum(len(system) + len(ag.task) + sum(t.max_tokens + len(t.result) for t in ag.turns[:k])
                 for ag in probe for k in range(len(ag.turns)))
    outputs = sum(t.max_tokens for ag in probe for t in ag.turns)
    print(f"agent trace replay: {args.agents} agents x {args.turns} turns, scale {args.scale}: system {len(system)} "
          f"tokens, final contexts up to {longest}, input:output {inputs / outputs:.0f}:1, one fork per agent; "
          f"device pool {device_blocks * bs} tokens (1.5 final contexts), host pool {host_blocks * bs}")
    print(f"{'mode':<34}{'task s':>9}{'prefill tokens':>16}{'TTFT p50 ms':>13}")
    for name, (wall, pre, ttft, _) in results.items():
        print(f"{name:<34}{wall:>9.1f}{pre:>16d}{statistics.median(ttft) * 1e3:>13.0f}")
    a = results[MODES[0][0]]
    for name, prefill_target, speed_target in ((MODES[1][0], 0.10, 2), (MODES[2][0], 0.03, 10)):
        b = results[name]
        print(f"(a) vs {name[:3]}: prefill tokens {a[1] / b[1]:.3f} (target <= {prefill_target}), "
              f"{b[0] / a[0]:.2f}x sooner (target >= {speed_target}x)")
    same = sum(x == y == z for x, y, z in zip(*(r[3] for r in results.values())))
    print(f"turn outputs identical in all modes: {same}/{len(a[3])}")
