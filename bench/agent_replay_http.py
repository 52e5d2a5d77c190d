"""The agent replay over HTTP (`bench/agent_replay.py --http`): each mode against its own real
`kog serve` process on loopback, the agents as concurrent asyncio clients.

  (a) sessions:  `/v1/sessions` in chat mode: open on [system, task] (pinned), then per turn
      append the tool message, generate (streamed), suspend while the tool "runs"; a fork turn
      forks 3 branches, generates in each and keeps the first.
  (b) stateless: `/v1/chat/completions`, every turn resending the whole conversation (the
      assistant replies as text), against a server started with --no-enable-prefix-caching;
      a fork turn asks for n=3 and keeps choice 0.

Prefill tokens computed come from each server's `kog_prefill_tokens_computed` counter (a fresh
server per mode, so everything it computed is the mode's); TTFT is request start to the first
streamed content.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from kog.testing.server_process import ServerProcess


@dataclass
class HttpAgent:
    system: str
    task: str
    turns: list                       # agent_replay.Turn; .result_text is the tool's reply
    messages: list[dict] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)


def sampling(turn, agent: int, t: int, branch: int = 0) -> dict:
    """Greedy, or seeded sampling on a fork turn (branch b of a session == choice b of n=3)."""
    if turn.fork:
        return {"temperature": 0.8, "seed": 1000 * agent + 10 * t + branch, "max_tokens": turn.max_tokens,
                "ignore_eos": True}
    return {"temperature": 0, "max_tokens": turn.max_tokens, "ignore_eos": True}


async def stream_text(client: httpx.AsyncClient, url: str, body: dict) -> tuple[list[str], float]:
    """POSTs a streaming chat request; returns the text of each choice and the time to its first content."""
    start = time.monotonic()
    first = None
    texts: dict[int, str] = {}
    async with client.stream("POST", url, json=dict(body, stream=True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            for ch in chunk["choices"]:
                piece = ch["delta"].get("content") or ""
                if piece and first is None:
                    first = time.monotonic() - start
                texts[ch["index"]] = texts.get(ch["index"], "") + piece
    return [texts.get(i, "") for i in range(len(texts))], first if first is not None else time.monotonic() - start


async def post(client: httpx.AsyncClient, url: str, body: dict | None = None) -> dict:
    r = await client.post(url, json=body or {})
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text}")
    return r.json()


async def run_session_agent(client: httpx.AsyncClient, i: int, ag: HttpAgent) -> None:
    sid = (await post(client, "/v1/sessions", {"messages": [{"role": "system", "content": ag.system},
                                                              {"role": "user", "content": ag.task}]}))["id"]
    for t, turn in enumerate(ag.turns):
        if t > 0:
            await post(client, f"/v1/sessions/{sid}/append",
                       {"messages": [{"role": "tool", "content": ag.turns[t - 1].result_text}]})
        if turn.fork:
            ids = (await post(client, f"/v1/sessions/{sid}/fork", {"n": 3}))["ids"]
            await client.delete(f"/v1/sessions/{sid}")  # the branches hold the shared KV now
            results = await asyncio.gather(*[stream_text(client, f"/v1/sessions/{b}/generate", sampling(turn, i, t, k))
                                             for k, b in enumerate(ids)])
            for b in ids[1:]:
                await client.delete(f"/v1/sessions/{b}")
            sid = ids[0]
            ag.outputs.append(results[0][0][0])
            ag.ttft.append(min(r[1] for r in results))
        else:
            texts, ttft = await stream_text(client, f"/v1/sessions/{sid}/generate", sampling(turn, i, t))
            ag.outputs.append(texts[0])
            ag.ttft.append(ttft)
        await post(client, f"/v1/sessions/{sid}/suspend")  # the tool runs
        await asyncio.sleep(turn.wait_s)
    await client.delete(f"/v1/sessions/{sid}")


async def run_stateless_agent(client: httpx.AsyncClient, i: int, ag: HttpAgent) -> None:
    ag.messages = [{"role": "system", "content": ag.system}, {"role": "user", "content": ag.task}]
    for t, turn in enumerate(ag.turns):
        if t > 0:
            ag.messages.append({"role": "tool", "content": ag.turns[t - 1].result_text})
        body = dict(sampling(turn, i, t), model="model", messages=ag.messages, n=3 if turn.fork else 1)
        texts, ttft = await stream_text(client, "/v1/chat/completions", body)
        ag.outputs.append(texts[0])
        ag.ttft.append(ttft)
        ag.messages.append({"role": "assistant", "content": texts[0]})
        await asyncio.sleep(turn.wait_s)


async def drive(url: str, agents: list[HttpAgent], sessions: bool) -> float:
    run_agent = run_session_agent if sessions else run_stateless_agent
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.monotonic()
        await asyncio.gather(*[run_agent(client, i, ag) for i, ag in enumerate(agents)])
        return time.monotonic() - start


def run_mode(model: str | None, agents: list[HttpAgent], sessions: bool, max_num_seqs: int) -> tuple[float, int]:
    """Runs every agent against a fresh `kog serve`; returns (wall seconds, prefill tokens computed)."""
    flags = ["--max-num-seqs", str(max_num_seqs)] + ([] if sessions else ["--no-enable-prefix-caching"])
    srv = ServerProcess(model, *flags, name="model", startup_timeout=300)
    try:
        wall = asyncio.run(drive(srv.url, agents, sessions))
        prefill = int(srv.metric("kog_prefill_tokens_computed_total"))
        leaked = srv.metric("kog_kv_blocks_used")
        if leaked:
            raise RuntimeError(f"{leaked:.0f} KV blocks still held after every session closed")
        return wall, prefill
    finally:
        srv.stop()
