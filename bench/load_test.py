"""Does `kog serve` hold up under N concurrent streaming clients, and what does batching buy?

    PYTHONPATH=python python bench/load_test.py [--clients 32] [--duration 120] [--tiny]

Starts `kog serve` (default model: SmolLM2-135M-Instruct; --tiny: a random-weight tiny model),
measures a batch-1 baseline (one client, requests back to back) and then N clients streaming
chat completions for D seconds, all in the same run. Every request shares a system prompt (a
prefix-cache hit after the first) and asks for --max-tokens tokens (ignore_eos). Afterwards it
reads /metrics: KV blocks still held once every request ended are leaked blocks (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kog.testing.server_process import ServerProcess, tiny_gguf

SYSTEM = "You are a concise assistant for an agent that plans trips and calls tools. "
QUESTIONS = ["Plan a day in Paris.", "What should I pack for Oslo?", "Name three museums in Rome.",
             "How do I get from Berlin to Prague?", "Suggest a dinner in Tokyo.", "Is Lisbon hilly?"]


@dataclass
class Phase:
    name: str
    clients: int
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)

    def row(self, base_tps: float | None) -> str:
        tps = self.tokens / self.wall_s if self.wall_s else 0.0
        p50 = _pct(self.ttft_s, 50) * 1e3
        p99 = _pct(self.ttft_s, 99) * 1e3
        ratio = f"{tps / base_tps:.2f}x" if base_tps else "1.00x"
        return (f"| {self.name:<12} | {self.clients:>7} | {self.requests:>8} | {len(self.errors):>6} | "
                f"{p50:>11.0f} | {p99:>11.0f} | {tps:>9.1f} | {ratio:>10} |")


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def one_request(http: httpx.AsyncClient, phase: Phase, i: int, max_tokens: int, system: str) -> None:
    body = {"model": "bench", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    first = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                phase.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    phase.errors.append(chunk["error"]["message"])
                    return
                if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.monotonic()
                if chunk.get("usage"):
                    phase.tokens += chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        phase.errors.append(f"{type(e).__name__}: {e}")
        return
    phase.requests += 1
    if first is not None:
        phase.ttft_s.append(first - start)


async def run_phase(url: str, phase: Phase, duration: float, max_tokens: int, system: str) -> Phase:
    """Each of phase.clients loops over requests until `duration` has passed (the last one finishes)."""
    limits = httpx.Limits(max_connections=phase.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.monotonic()

        async def client(c: int) -> None:
            i = c
            while time.monotonic() - start < duration:
                await one_request(http, phase, i, max_tokens, system)
                i += phase.clients

        await asyncio.gather(*(client(c) for c in range(phase.clients)))
        phase.wall_s = time.monotonic() - start
    return phase


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of the N-client phase")
    ap.add_argument("--baseline-duration", type=float, default=None,
                    help="seconds of the batch-1 phase (default: a quarter of --duration, at least 5)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="a random-weight tiny model (fast, meaningless text)")
    ap.add_argument("--server-flag", action="append", default=[], help="extra `kog serve` flag (repeatable)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_gguf(Path(tmp)) if args.tiny else args.model
        flags = ["--max-num-seqs", str(args.clients), "--max-waiting", str(4 * args.clients), *args.server_flag]
        srv = ServerProcess(model, *flags, name="bench", startup_timeout=300)
        system = SYSTEM if args.tiny else SYSTEM * 3  # the tiny model's context is 256 tokens
        try:
            base = asyncio.run(run_phase(srv.url, Phase("batch-1", 1),
                                         args.baseline_duration or max(5.0, args.duration / 4), args.max_tokens, system))
            load = asyncio.run(run_phase(srv.url, Phase(f"{args.clients} clients", args.clients), args.duration,
                                         args.max_tokens, system))
            time.sleep(0.5)
            leaked = srv.metric("kog_kv_blocks_used")
            running = srv.metric("kog_num_requests_running") + srv.metric("kog_num_requests_waiting")
            hits = srv.metric("kog_prefix_cache_hits_total")
            queries = srv.metric("kog_prefix_cache_queries_total")
        finally:
            srv.terminate()
            exit_code = srv.proc.wait(120)
            srv.stop()

    base_tps = base.tokens / base.wall_s if base.wall_s else None
    print(f"\nkog serve {'tiny model' if args.tiny else args.model or 'SmolLM2-135M-Instruct'}, "
          f"{args.max_tokens} tokens per request, streaming chat completions")
    print("| phase        | clients | requests | errors | TTFT p50 ms | TTFT p99 ms |     tok/s | vs batch-1 |")
    print("|--------------|---------|----------|--------|-------------|-------------|-----------|------------|")
    print(base.row(None))
    print(load.row(base_tps))
    print(f"\nKV blocks still used after the run (leaked): {leaked:.0f}; requests left running/waiting: {running:.0f}")
    print(f"prefix cache: {hits:.0f} of {queries:.0f} prompt tokens hit; server exit status after SIGTERM: {exit_code}")
    for err in (base.errors + load.errors)[:5]:
        print(f"error: {err}")


if __name__ == "__main__":
    main()
