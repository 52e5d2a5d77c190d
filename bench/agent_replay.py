"""Do agent sessions beat resending the conversation? A synthetic agent workload, run twice on
the same model in the same process:

  (a) sessions:  every agent opens a Kog session on the shared system prompt (pinned, computed
      once), then each turn appends only the tool result and generates;
  (b) stateless: every turn resends the whole conversation as a new request, prefix cache OFF.

    PYTHONPATH=python python bench/agent_replay.py            # 8 agents x 10 turns, ~1.5k system
    PYTHONPATH=python python bench/agent_replay.py --quick    # 2 agents x 3 turns, ~200 system
    PYTHONPATH=python python bench/agent_replay.py --http     # the same over HTTP: /v1/sessions vs
                                                              # stateless /v1/chat/completions, each
                                                              # against its own `kog serve` process
    PYTHONPATH=python python bench/agent_replay.py --trace    # coding-agent traces (>= 30 turns,
                                                              # 64k+ contexts at --scale 1) on a tiny
                                                              # long-context model vs stateless with
                                                              # prefix caching on and off (agent_trace.py)

Workload (seeded): a system prompt with tool schemas (~--system-tokens tokens, ChatML through
the chat template); per agent a task; per turn the model generates a tool call of 20-40 tokens
(max_tokens, ignore_eos), the tool "runs" 50-500 ms (a real wait, the session suspended), its
result is appended. Turns in --fork-turns fork 3 branches (seeded sampling, n=3 when
stateless) and keep the first. Agents run concurrently in one in-process driver loop, so the
engine batches them. Both modes see token-identical contexts except where their own outputs
differ (printed: how many turn outputs match).

Prints task completion time, prefill tokens computed, TTFT p50/p90 per mode, and ratios
(targets: (a) computes <= 10% of (b)'s prefill tokens and finishes >= 2x sooner).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from kog.engine import EngineConfig, LLMEngine
from kog.sampling_params import SamplingParams

TOOL_NAMES = ["get_weather", "search_web", "read_file", "write_file", "run_python", "query_db",
              "send_email", "list_dir", "http_get", "calendar_lookup", "translate", "summarize"]


@dataclass
class Turn:
    max_tokens: int
    wait_s: float
    result: list[int]          # the tool result, rendered as a tool turn, as token ids
    fork: bool
    result_text: str = ""      # the tool result (the content of the tool message)


@dataclass
class Agent:
    name: str
    task: list[int]            # the agent's user message tokens (after the system prompt)
    turns: list[Turn]
    system_text: str = ""      # the system prompt and the task, as text (the HTTP mode's messages)
    task_text: str = ""
    context: list[int] = field(default_factory=list)
    session: str | None = None
    turn: int = 0
    wake: float = 0.0          # when its tool result arrives (driver clock)
    pending: list[str] = field(default_factory=list)  # request ids of the turn in flight
    submitted: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    current: Turn | None = None                        # the turn in flight
    branches: list[str] = field(default_factory=list)  # its branch sessions (a fork turn)


def build_workload(llm, args) -> tuple[list[int], list[Agent]]:
    """The shared system prompt (token ids) and the agents' tasks and turns, all seeded."""
    rng = random.Random(args.seed)
    tools, system_ids = [], []
    while len(system_ids) < args.system_tokens:
        i = len(tools)
        tools.append({"type": "function", "function": {
            "name": f"{TOOL_NAMES[i % len(TOOL_NAMES)]}_{i}",
            "description": f"Tool {i}: " + " ".join(rng.choice(["fetch", "the", "value", "of", "a", "resource",
                                                                  "given", "its", "name", "and", "options"]) for _ in range(24)),
            "parameters": {"type": "object", "properties": {
                "name": {"type": "string", "description": "what to act on"},
                "limit": {"type": "integer", "description": "most results"}}, "required": ["name"]}}})
        system = ("You are an autonomous agent. Call exactly one tool per turn as JSON "
                  '{"name": ..., "arguments": {...}}. Tools:\n' + json.dumps(tools, indent=1))
        system_ids = encode(llm, [{"role": "system", "content": system}], generation=False)
    fork_turns = {int(t) for t in args.fork_turns.split(",") if t != ""}
    agents = []
    for a in range(args.agents):
        task_text = f"Task {a}: plan a trip to city {a} and book it."
        task = llm.tokenizer.encode(f"<|im_start|>user\n{task_text}<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)
        turns = []
        for t in range(args.turns):
            result = json.dumps({"tool": f"call_{t}", "result": [rng.randint(0, 10**6) for _ in range(rng.randint(4, 12))]})
            tool_turn = llm.tokenizer.encode(f"<|im_end|>\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n",
                                             add_special_tokens=False)
            turns.append(Turn(rng.randint(20, 40), rng.uniform(0.05, 0.5), tool_turn, t in fork_turns, result))
        agents.append(Agent(f"agent{a}", task, turns, system, task_text))
    return system_ids, agents


def encode(llm, messages, generation) -> list[int]:
    if llm.chat_template is None:  # a model without a template: plain text
        return llm.tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=False)
    return llm.encode_chat(messages, add_generation_prompt=generation)


def params_for(turn: Turn, agent: int, t: int, branch: int = 0, n: int = 1) -> SamplingParams:
    if turn.fork:  # seeded sampling: branch i of a session == completion i of an n=3 request
        return SamplingParams(n=n, temperature=0.8, seed=1000 * agent + 10 * t + branch,
                              max_tokens=turn.max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=turn.max_tokens, ignore_eos=True)


class Driver:
    """Runs every agent to completion on one engine; `sessions` picks mode (a) or (b)."""

    def __init__(self, engine: LLMEngine, system: list[int], agents: list[Agent], sessions: bool) -> None:
        self.engine, self.system, self.agents, self.sessions = engine, system, agents, sessions
        self.prefill_tokens = 0
        self.ttft: list[float] = []
        self.ids = 0

    def run(self) -> float:
        start = time.monotonic()
        opens = []
        for i, ag in enumerate(self.agents):
            ag.context = self.system + ag.task
            if self.sessions:
                ag.session = f"{ag.name}/s0"
                opens.append(self.engine.sessions.open(ag.session, ag.context))
        while opens:  # the shared prefix is computed once, then hit by every other agent
            self.engine.step()
            for rid in [r for r in opens if self.engine.is_finished(r)]:
                self.prefill_tokens += self.engine.get_output(rid).prefill_tokens_computed
                self.engine.release(rid)
                opens.remove(rid)
        for ag in self.agents:
            ag.wake = time.monotonic()
        while any(ag.turn < len(ag.turns) for ag in self.agents):
            now = time.monotonic()
            for i, ag in enumerate(self.agents):
                if not ag.pending and ag.turn < len(ag.turns) and ag.wake <= now:
                    self._submit(i, ag)
            if self.engine.has_unfinished():
                self.engine.step()
            else:
                wakes = [ag.wake for ag in self.agents if not ag.pending and ag.turn < len(ag.turns)]
                time.sleep(max(0.0, min(wakes) - time.monotonic()))
            for i, ag in enumerate(self.agents):
                if ag.pending and all(self.engine.is_finished(r) for r in ag.pending):
                    self._complete(i, ag)
        for ag in self.agents:
            if ag.session:
                self.engine.sessions.close(ag.session)
        return time.monotonic() - start

    def _submit(self, i: int, ag: Agent) -> None:
        turn = ag.current = ag.turns[ag.turn]
        if ag.turn > 0:  # the previous tool's result arrives
            prev = ag.turns[ag.turn - 1].result
            if self.sessions:
                self.engine.sessions.append(ag.session, prev)
            else:
                ag.context = ag.context + prev
        ag.submitted = time.monotonic()
        self.ids += 1
        if not self.sessions:
            rid = f"{ag.name}/t{ag.turn}"
            self.engine.add_request(rid, ag.context, params_for(turn, i, ag.turn, n=3 if turn.fork else 1))
            ag.pending = [rid]
        elif turn.fork:  # compute the tool result once, then fork (see _complete)
            rid = f"{ag.session}/t{ag.turn}/prefill"
            self.engine.sessions.prefill(ag.session, rid)
            ag.pending = [rid]
            ag.branches = []
        else:
            rid = f"{ag.session}/t{ag.turn}"
            self.engine.sessions.generate(ag.session, rid, params_for(turn, i, ag.turn))
            ag.pending = [rid]

    def _fork(self, i: int, ag: Agent) -> None:
        self.prefill_tokens += self.engine.get_output(ag.pending[0]).prefill_tokens_computed
        self.engine.release(ag.pending[0])
        ag.branches = [f"{ag.name}/s{ag.turn}b{b}" for b in range(3)]
        self.engine.sessions.fork(ag.session, ag.branches)
        self.engine.sessions.close(ag.session)  # the branches hold the shared KV now
        ag.pending = []
        for b, sid in enumerate(ag.branches):
            rid = f"{sid}/t{ag.turn}"
            self.engine.sessions.generate(sid, rid, params_for(ag.current, i, ag.turn, branch=b))
            ag.pending.append(rid)

    def _complete(self, i: int, ag: Agent) -> None:
        if self.sessions and ag.current.fork and not ag.branches:
            self._fork(i, ag)
            return
        outs = [self.engine.get_output(r) for r in ag.pending]
        first = min(o.metrics["first_token_time"] for o in outs)
        self.ttft.append(first - ag.submitted)
        self.prefill_tokens += sum(o.prefill_tokens_computed for o in outs)
        kept = outs[0].outputs[0].token_ids  # branch 0 / completion 0 is kept
        ag.outputs.append(kept)
        if self.sessions:
            if ag.current.fork:
                for sid in ag.branches[1:]:
                    self.engine.sessions.close(sid)
                ag.session = ag.branches[0]
            self.engine.sessions.suspend(ag.session)  # the tool runs
        else:
            ag.context = ag.context + kept
        for r in ag.pending:
            self.engine.release(r)
        ag.pending = []
        ag.wake = time.monotonic() + ag.current.wait_s
        ag.turn += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--fork-turns", default="3,7", help="comma-separated turn indexes that fork 3 branches")
    ap.add_argument("--quick", action="store_true", help="2 agents x 3 turns, ~200-token system prompt, fork at turn 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--http", action="store_true",
                    help="run both modes over HTTP against real `kog serve` processes (see agent_replay_http.py)")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="the HTTP servers' --max-num-seqs")
    ap.add_argument("--trace", action="store_true",
                    help="coding-agent traces on a tiny long-context model, vs stateless with prefix caching on and off")
    ap.add_argument("--scale", type=float, default=0.25, help="--trace: token counts x this (1: contexts past 64k)")
    args = ap.parse_args()
    if args.trace:
        from agent_trace import run_trace

        if "--turns" not in sys.argv:
            args.turns = 40
        if "--agents" not in sys.argv:
            args.agents = 3
        run_trace(args)
        return
    if args.quick:
        args.agents, args.turns, args.system_tokens, args.fork_turns = 2, 3, 200, "1"
    import kog

    llm = kog.LLM(args.model)
    system, _ = build_workload(llm, args)
    results = {}
    for mode, sessions in (("sessions", True), ("stateless", False)):
        _, agents = build_workload(llm, args)
        if args.http:
            results[mode] = run_http(args, agents, sessions)
        else:
            results[mode] = run_in_process(llm, system, agents, sessions)
        print(f"# {mode}: {results[mode][0]:.1f} s, {results[mode][1]} prefill tokens", flush=True)
    report(args, len(system), results, "HTTP, one `kog serve` per mode" if args.http else "in process")


def run_in_process(llm, system, agents, sessions) -> tuple[float, int, list[float], list]:
    """One mode on a fresh engine over the LLM's runner: (wall s, prefill tokens, TTFTs, turn outputs)."""
    cfg = llm.engine.config
    engine = LLMEngine(llm.engine.runner, llm.tokenizer, llm.engine.eos_token_ids, llm.engine.max_model_len,
                       EngineConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                                    cfg.num_host_blocks, cfg.namespace, enable_prefix_caching=sessions))
    driver = Driver(engine, system, agents, sessions)
    wall = driver.run()
    return wall, driver.prefill_tokens, driver.ttft, [o for ag in agents for o in ag.outputs]


def run_http(args, agents, sessions) -> tuple[float, int, list[float], list]:
    """One mode over HTTP against a fresh `kog serve`: (wall s, prefill tokens, TTFTs, turn outputs as text)."""
    from agent_replay_http import HttpAgent, run_mode

    http_agents = [HttpAgent(ag.system_text, ag.task_text, ag.turns) for ag in agents]
    wall, prefill = run_mode(args.model, http_agents, sessions, args.max_num_seqs)
    return wall, prefill, [x for ag in http_agents for x in ag.ttft], [o for ag in http_agents for o in ag.outputs]


def report(args, system_tokens: int, results: dict, how: str) -> None:
    import kog

    a, b = results["sessions"], results["stateless"]
    same = sum(x == y for x, y in zip(a[3], b[3]))
    print(f"agent replay ({how}): {args.agents} agents x {args.turns} turns, system prompt {system_tokens} "
          f"tokens, fork turns {args.fork_turns or 'none'}; {kog.backend_info().get('cpu_isa', '')}")
    print(f"{'mode':<28}{'completion s':>13}{'prefill tokens':>16}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}")
    for name, (wall, pre, ttft, _) in (("(a) Kog sessions", a), ("(b) stateless, no prefix cache", b)):
        q = statistics.quantiles(ttft, n=10) if len(ttft) > 1 else ttft * 9
        print(f"{name:<28}{wall:>13.1f}{pre:>16d}{statistics.median(ttft) * 1e3:>13.0f}{q[8] * 1e3:>13.0f}")
    print(f"ratios (a)/(b): prefill tokens {a[1] / b[1]:.3f} (target <= 0.10), completion time "
          f"{a[0] / b[0]:.3f} (speedup {b[0] / a[0]:.2f}x, target >= 2x), TTFT p50 "
          f"{statistics.median(a[2]) / statistics.median(b[2]):.3f}")
    print(f"turn outputs identical in both modes: {same}/{len(a[3])}")

if __name__ == "__main__":
    main()
