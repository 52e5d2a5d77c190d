"""max_tokens never costs a tool call, with the real SmolLM2-135M-Instruct behind the HTTP server:
10 realistic tools (nested objects, enums, arrays, patterns, required fields, no length bounds) at
temperature 1.0 and max_tokens 200, where this model writes strings for hundreds of tokens and
repeats its calls: every reply, whole (tool_choice "required" over all ten tools) or streamed
(tool_choice naming the tool), has at least one call whose arguments validate with jsonschema.
One in-process server; the 20 requests run concurrently, batched by the engine."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

import kog
from kog.engine import AsyncEngine
from kog.server import ServerConfig, build_app

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow


def obj(properties, required):
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


UNITS = ["m", "km", "mi", "ft", "kg", "lb", "c", "f"]
TOOLS = {  # name: (the user's request, the parameters)
    "get_weather": ("What's the weather in Lyon tomorrow, in celsius?", obj({
        "location": obj({"city": {"type": "string"}, "country": {"type": "string"}}, ["city"]),
        "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        ["location", "unit"])),
    "web_search": ("Search the web for recent news about the James Webb telescope.", obj({
        "query": {"type": "string", "minLength": 1}, "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
        "safe_search": {"type": "boolean"}, "sites": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        ["query"])),
    "write_file": ("Save the text 'hello world' to notes/todo.txt.", obj({
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"enum": ["overwrite", "append"]},
        "encoding": {"enum": ["utf-8", "ascii", "latin-1"]}}, ["path", "content", "mode"])),
    "create_calendar_event": ("Book a meeting with Ana and Bo on 2025-03-14 at 10:00 for 30 minutes.", obj({
        "title": {"type": "string"},
        "start": obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                      "time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}}, ["date", "time"]),
        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
        "attendees": {"type": "array", "items": obj({"name": {"type": "string"}, "optional": {"type": "boolean"}},
                                                    ["name"])}},
        ["title", "start", "duration_minutes"])),
    "send_email": ("Email bob@example.com that the report is late.", obj({
        "to": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1},
        "subject": {"type": "string"}, "body": {"type": "string"}, "priority": {"enum": ["low", "normal", "high"]}},
        ["to", "subject", "body"])),
    "run_sql": ("How many orders were placed in 2024? Query the orders table.", obj({
        "query": {"type": "string"}, "database": {"enum": ["sales", "inventory", "hr"]},
        "params": {"type": "array", "items": {"type": ["string", "number", "null"]}},
        "read_only": {"type": "boolean"}}, ["query", "database"])),
    "http_request": ("GET https://api.example.com/users/42 with an Accept: application/json header.", obj({
        "method": {"enum": ["GET", "POST", "PUT", "DELETE", "PATCH"]}, "url": {"type": "string"},
        "headers": {"type": "object", "additionalProperties": {"type": "string"}},
        "timeout_s": {"type": "number", "minimum": 0, "maximum": 120}}, ["method", "url"])),
    "convert_units": ("Convert 5 miles to kilometers.", obj({
        "value": {"type": "number"}, "from_unit": {"enum": UNITS}, "to_unit": {"enum": UNITS}},
        ["value", "from_unit", "to_unit"])),
    "run_shell": ("List the files in /var/log, sorted by size.", obj({
        "command": {"type": "string"}, "args": {"type": "array", "items": {"type": "string"}},
        "cwd": {"type": "string"}, "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600}}, ["command"])),
    "create_ticket": ("Open a high-priority bug: the login page crashes on Safari.", obj({
        "title": {"type": "string"}, "description": {"type": "string"}, "kind": {"enum": ["bug", "feature", "task"]},
        "priority": {"enum": ["low", "medium", "high", "critical"]},
        "labels": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "assignee": obj({"team": {"enum": ["web", "backend", "mobile"]}, "user": {"type": "string"}}, ["team"])},
        ["title", "kind", "priority"])),
}
DEFINITIONS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, (_, p) in TOOLS.items()]
CASES = [(name, stream) for stream in (False, True) for name in TOOLS]


@pytest.fixture(scope="module")
def replies():
    """{(tool, stream): (tool calls as [(name, arguments text)], content, finish_reason)} for every case."""
    llm = kog.LLM(max_num_seqs=len(CASES), max_model_len=2048)  # the tools in the prompt: ~1.5k tokens
    engine = AsyncEngine(llm.engine)
    client = TestClient(build_app(engine, llm.tokenizer, llm.chat_template, ServerConfig()))
    try:
        with ThreadPoolExecutor(len(CASES)) as pool:
            yield dict(zip(CASES, pool.map(lambda case: ask(client, *case), CASES)))
    finally:
        client.close()
        engine.close(drain=False, timeout=10)


def ask(client, name, stream):
    """Whole replies may call any of the ten tools; streamed ones are made to call `name`."""
    choice = {"type": "function", "function": {"name": name}} if stream else "required"
    body = {"model": "kog", "messages": [{"role": "user", "content": TOOLS[name][0]}], "tools": DEFINITIONS,
            "tool_choice": choice, "temperature": 1.0, "max_tokens": 200, "seed": len(name), "stream": stream}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        [c] = r.json()["choices"]
        calls, content, finish = c["message"]["tool_calls"] or [], c["message"]["content"] or "", c["finish_reason"]
    else:
        chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        calls = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
        content, finish = "".join(d["delta"].get("content") or "" for d in deltas), deltas[-1]["finish_reason"]
    return [(t["function"]["name"], t["function"]["arguments"]) for t in calls], content, finish


@pytest.mark.parametrize("name, stream", CASES)
def test_every_reply_has_a_valid_call(replies, name, stream):
    calls, content, finish = replies[name, stream]
    assert calls and not content, f"no tool call ({finish}): {content}"
    assert finish == "tool_calls"  # the model stopped after its calls: max_tokens cut none
    for called, arguments in calls:
        assert called == name if stream else called in TOOLS
        jsonschema.validate(json.loads(arguments), TOOLS[called][1])
