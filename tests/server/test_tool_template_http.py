"""A model whose chat template ignores `tools`, served with Kog's Hermes tool template as its
tool_template (what the loader gives ChatML models): the tools reach the prompt, and a reply in
the Hermes format comes back as tool_calls under tool_choice "auto", whole and streamed."""

from __future__ import annotations

import json

import pytest

from kog.loader import ChatTemplate
from kog.loader.chat_template import hermes_tool_template
from kog.testing.tiny_models import CHATML_TEMPLATE

from server_helpers import TOK, ScriptedRunner, make_engine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def hermes_client(make_client):
    template = ChatTemplate(CHATML_TEMPLATE, tool_template=hermes_tool_template())
    runner = ScriptedRunner(TOK.encode(REPLY), TOK.eos_token_id, num_blocks=512)  # the tiny vocabulary makes long prompts
    return make_client(make_engine(runner, max_model_len=2048), template=template)


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, "max_tokens": 64,
                                                  "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r


def test_tools_change_the_prompt(hermes_client):
    without = chat(hermes_client).json()["usage"]["prompt_tokens"]
    with_tools = chat(hermes_client, tools=TOOLS).json()["usage"]["prompt_tokens"]
    rendered = hermes_tool_template().render(MSGS, TOOLS, add_generation_prompt=True)
    assert with_tools == len(TOK.encode(rendered, add_special_tokens=False)) > without


def test_a_hermes_reply_is_parsed_under_auto(hermes_client):
    [choice] = chat(hermes_client, tools=TOOLS, tool_choice="auto").json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_hermes_reply_is_parsed_under_auto_when_streamed(hermes_client):
    r = chat(hermes_client, tools=TOOLS, tool_choice="auto", stream=True)
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    calls = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls") or []]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert not "".join(ch["delta"].get("content") or "" for e in events for ch in e["choices"]).strip()


def test_a_session_opened_with_tools_shows_them_and_appends_through_the_tool_template(hermes_client):
    r = hermes_client.post("/v1/sessions", json={"messages": MSGS, "tools": TOOLS})
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    ids = hermes_client.get(f"/v1/sessions/{sid}").json()["token_ids"]
    assert "<tools>" in TOK.decode(ids) and '"name": "get_weather"' in TOK.decode(ids)
    turn = hermes_client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 64, "temperature": 0}).json()
    assert turn["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    r = hermes_client.post(f"/v1/sessions/{sid}/append", json={"messages": [{"role": "tool", "content": "21 C"}]})
    assert r.status_code == 200, r.text  # the tool template renders incrementally
    assert TOK.decode(hermes_client.get(f"/v1/sessions/{sid}").json()["token_ids"]).endswith(
        "<|im_start|>tool\n<tool_response>\n21 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
