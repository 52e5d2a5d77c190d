"""Forced tool calls (tool_choice "required"): model forwards per output token and wall time of
Kog with jump-forward + n-gram speculation against plain constrained decoding (one forward per
token) and unconstrained decoding of the same number of tokens, all measured in the same run.

    PYTHONPATH=python python bench/tool_calls.py [--quick] [--model PATH] [--k 4]

Greedy, one request at a time through kog.LLM.chat, the prompt's KV already in the prefix cache
(a warm-up request per tool), so every mode starts from the same state. Targets: <= 0.5 forwards per output token
and >= 2x wall-time speedup over plain constrained decoding, with the same tokens.
"""

from __future__ import annotations

import argparse
import time

import torch

import kog
from kog.structured_output.grammar import build_constraint
from kog.speculation.params import SpeculativeParams
from kog.structured_output.params import StructuredOutputParams


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


S = {"type": "string", "maxLength": 40}
TOOLS = [
    (tool("get_weather", "Current weather in a city", {
        "city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
     "What's the weather in Paris right now, in celsius?"),
    (tool("search_flights", "Search flights between two airports", {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"}, "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "passengers": {"type": "object", "properties": {"adults": {"type": "integer", "minimum": 1, "maximum": 9},
                                                        "children": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["adults", "children"], "additionalProperties": False},
        "cabin": {"enum": ["economy", "premium_economy", "business", "first"]}},
        ["origin", "destination", "date", "passengers", "cabin"]),
     "Find me a business class flight from CDG to JFK on 2026-12-24 for two adults and one child."),
    (tool("create_calendar_event", "Create an event in the user's calendar", {
        "title": S, "start": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}$"},
        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "reminder": {"enum": ["none", "5m", "15m", "1h", "1d"]}},
        ["title", "start", "duration_minutes", "attendees", "reminder"]),
     "Schedule a 30 minute 'Design review' on 2026-12-03T14:00 with alice@example.com, remind me 15m before."),
    (tool("send_email", "Send an email", {
        "to": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}, "subject": S,
        "body": {"type": "string", "maxLength": 120}, "priority": {"enum": ["low", "normal", "high"]}},
        ["to", "subject", "body", "priority"]),
     "Email bob@example.com with subject 'Lunch' saying 'Are you free at noon tomorrow?'"),
    (tool("run_sql", "Run a read-only SQL query on the analytics database", {
        "query": {"type": "string", "maxLength": 160}, "database": {"enum": ["analytics", "billing", "users"]},
        "limit": {"type": "integer", "minimum": 1, "maximum": 1000}}, ["query", "database", "limit"]),
     "How many users signed up last week? Query the users database, at most 10 rows."),
    (tool("read_file", "Read part of a file in the repository", {
        "path": {"type": "string", "maxLength": 80}, "start_line": {"type": "integer", "minimum": 1, "maximum": 100000},
        "end_line": {"type": "integer", "minimum": 1, "maximum": 100000}}, ["path", "start_line", "end_line"]),
     "Show me lines 10 to 40 of src/engine/scheduler.py."),
    (tool("set_thermostat", "Set a room's thermostat", {
        "room": {"enum": ["living_room", "bedroom", "kitchen", "office"]},
        "target": {"type": "number", "minimum": 10, "maximum": 30}, "mode": {"enum": ["heat", "cool", "auto", "off"]},
        "schedule": {"type": "object", "properties": {"start": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
                                                      "end": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}},
                     "required": ["start", "end"], "additionalProperties": False}},
        ["room", "target", "mode", "schedule"]),
     "Heat the bedroom to 21 degrees from 06:30 to 08:00."),
    (tool("create_issue", "Open an issue in the tracker", {
        "repository": S, "title": S, "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs", "perf"]},
                                                "maxItems": 3},
        "assignee": {"type": ["string", "null"], "maxLength": 30}, "severity": {"enum": ["low", "medium", "high", "critical"]}},
        ["repository", "title", "labels", "assignee", "severity"]),
     "File a high severity bug in kog/kog titled 'KV leak after abort', unassigned."),
    (tool("convert_currency", "Convert an amount between currencies", {
        "amount": {"type": "number", "minimum": 0, "maximum": 1e9}, "from": {"enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
        "to": {"enum": ["USD", "EUR", "GBP", "JPY", "CHF"]}}, ["amount", "from", "to"]),
     "How much is 250 euros in US dollars?"),
    (tool("order_food", "Order food for delivery", {
        "restaurant": S, "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"name": S, "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["name", "quantity"], "additionalProperties": False}},
        "address": S, "tip_percent": {"type": "integer", "minimum": 0, "maximum": 30}},
        ["restaurant", "items", "address", "tip_percent"]),
     "Order two margherita pizzas from Luigi's to 12 Rue de Rivoli with a 15 percent tip."),
]
QUICK = 3


def run_one(llm: kog.LLM, messages, tools, params) -> tuple[list[int], int, float]:
    """(output ids, model forwards, wall seconds) of one greedy request alone."""
    t0 = time.perf_counter()
    if params.structured is None:
        out = llm.chat(messages, params, tools=tools)[0]
    else:
        out = llm.generate({"prompt_token_ids": llm.encode_chat(messages, tools)}, params)[0]
    return out.outputs[0].token_ids, out.num_forward_passes, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--quick", action="store_true", help=f"the first {QUICK} schemas only")
    ap.add_argument("--k", type=int, default=4, help="speculative draft tokens")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    torch.manual_seed(0)
    llm = kog.LLM(args.model, max_num_seqs=2)
    cases = TOOLS[:QUICK] if args.quick else TOOLS
    for spec, _ in cases:  # compile (and cache) every grammar before timing anything
        build_constraint(llm.tokenizer, StructuredOutputParams(tools=[spec], tool_choice="required",
                                                               parallel_tool_calls=False),
                         llm.engine.eos_token_ids, llm.engine.runner.vocab_size)
    modes = ["plain constrained", "jump-forward", "jump-forward + ngram", "unconstrained"]
    totals = {m: [0, 0, 0.0] for m in modes}  # tokens, forwards, seconds
    print(f"{'tool':<22} {'mode':<22} {'tokens':>6} {'fwd':>5} {'fwd/tok':>8} {'wall s':>7} {'speedup':>8} same")
    for spec, user in cases:
        messages = [{"role": "user", "content": user}]
        # Every mode then finds the prompt in the prefix cache (all but its last block): same start.
        llm.generate({"prompt_token_ids": llm.encode_chat(messages, [spec])}, kog.SamplingParams(max_tokens=1))
        structured = dict(tools=[spec], tool_choice="required", parallel_tool_calls=False)
        base = None
        for mode in modes:
            p = kog.SamplingParams(temperature=0, max_tokens=args.max_tokens)
            if mode != "unconstrained":
                p.structured = StructuredOutputParams(**structured, jump_forward=mode != "plain constrained")
            if mode == "jump-forward + ngram":
                p.speculative = SpeculativeParams("ngram", args.k)
            if mode == "unconstrained":  # the same number of tokens, free
                p.max_tokens, p.ignore_eos = len(base[0]), True
            ids, fwd, wall = run_one(llm, messages, [spec], p)
            if base is None:
                base = (ids, wall)
            same = "-" if mode == "unconstrained" else ("yes" if ids == base[0] else "NO")
            t = totals[mode]
            t[0], t[1], t[2] = t[0] + len(ids), t[1] + fwd, t[2] + wall
            print(f"{spec['function']['name']:<22} {mode:<22} {len(ids):>6} {fwd:>5} {fwd / len(ids):>8.2f} "
                  f"{wall:>7.2f} {base[1] / wall:>7.2f}x {same}")
        print(f"  output: {llm.tokenizer.decode(base[0])!r}")
    print()
    print(f"{'TOTAL':<22} {'mode':<22} {'tokens':>6} {'fwd':>5} {'fwd/tok':>8} {'wall s':>7} {'speedup':>8}")
    for mode, (n, fwd, wall) in totals.items():
        print(f"{'':<22} {mode:<22} {n:>6} {fwd:>5} {fwd / n:>8.2f} {wall:>7.2f} "
              f"{totals['plain constrained'][2] / wall:>7.2f}x")


if __name__ == "__main__":
    main()
