"""/v1/chat/completions in process over the fake model: shapes, streaming, n, logprobs, usage, tools."""

import json

import kog
from kog.llm import LLM

from server_helpers import TOK, TEMPLATE, ScriptedRunner, make_engine

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the quick brown fox"}]


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "kog", "messages": MSGS, **body})


def sse_chunks(response):
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_whole_response_matches_the_offline_api(client):
    r = chat(client, max_tokens=8, temperature=0)
    assert r.status_code == 200
    body = r.json()
    expected = LLM.from_engine(make_engine(), TOK, TEMPLATE).chat(
        MSGS, kog.SamplingParams(max_tokens=8, temperature=0))[0]
    assert body["object"] == "chat.completion" and body["model"] == "kog" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.outputs[0].text, "tool_calls": None}
    assert choice["finish_reason"] == expected.outputs[0].finish_reason
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(expected.prompt_token_ids)
    assert usage["completion_tokens"] == len(expected.outputs[0].token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_stream_concatenates_to_the_whole_response_with_usage(client):
    whole = chat(client, max_tokens=12, temperature=0).json()
    r = chat(client, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(r)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [whole["choices"][0]["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_n_choices_seeded_sampling_and_stop(client):
    body = chat(client, max_tokens=6, n=3, temperature=1.0, seed=7).json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
    assert body["usage"]["completion_tokens"] <= 18
    again = chat(client, max_tokens=6, n=3, temperature=1.0, seed=7).json()
    assert [c["message"]["content"] for c in body["choices"]] == [c["message"]["content"] for c in again["choices"]]
    text = body["choices"][0]["message"]["content"]
    if len(text) > 2:
        cut = chat(client, max_tokens=6, n=3, temperature=1.0, seed=7, stop=[text[1:3]]).json()
        assert cut["choices"][0]["message"]["content"] == text[:text.index(text[1:3])]
        assert cut["choices"][0]["finish_reason"] == "stop"


def test_stream_n_gt_1_every_choice_finishes(client):
    chunks = sse_chunks(chat(client, max_tokens=5, n=2, stream=True, seed=1))
    finished = {ch["index"]: ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]}
    assert finished == {0: "length", 1: "length"}


def test_logprobs_chat_format(client):
    body = chat(client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for tok in content:
        assert len(tok["top_logprobs"]) == 3 and tok["logprob"] <= 0
        assert tok["top_logprobs"][0]["logprob"] == max(t["logprob"] for t in tok["top_logprobs"])
        assert tok["logprob"] == tok["top_logprobs"][0]["logprob"]  # greedy: the sampled token is the best
    streamed = sse_chunks(chat(client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, stream=True))
    tokens = [t for c in streamed for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["content"]]
    assert tokens == content
    assert chat(client, max_tokens=4, logprobs=False).json()["choices"][0]["logprobs"] is None


def test_cached_tokens_rise_on_a_repeated_prefix(client):
    long_msgs = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 4}]
    first = client.post("/v1/chat/completions", json={"model": "kog", "messages": long_msgs, "max_tokens": 2}).json()
    second = client.post("/v1/chat/completions", json={"model": "kog", "messages": long_msgs, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > first["usage"]["prompt_tokens"] // 2


# ---- tools ------------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def scripted_client(make_client, reply: str, **config):
    return make_client(make_engine(ScriptedRunner(TOK.encode(reply), TOK.eos_token_id)), **config)


def test_tool_call_parsed_with_finish_reason_tool_calls(make_client):
    client = scripted_client(make_client, "Checking. " + CALL)
    body = chat(client, tools=TOOLS, max_tokens=64, temperature=0).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # without tools the same text is plain content
    plain = chat(client, max_tokens=64, temperature=0).json()["choices"][0]
    assert plain["message"]["content"] == "Checking. " + CALL and plain["finish_reason"] == "stop"
    none = chat(client, tools=TOOLS, tool_choice="none", max_tokens=64, temperature=0).json()["choices"][0]
    assert none["message"]["tool_calls"] is None


def test_parallel_tool_calls_false_keeps_the_first(make_client):
    client = scripted_client(make_client, CALL + CALL.replace("Paris", "Rome"))
    both = chat(client, tools=TOOLS, max_tokens=200, temperature=0).json()["choices"][0]["message"]["tool_calls"]
    one = chat(client, tools=TOOLS, max_tokens=200, temperature=0, parallel_tool_calls=False).json()
    assert [json.loads(c["function"]["arguments"])["city"] for c in both] == ["Paris", "Rome"]
    assert [c["function"]["name"] for c in one["choices"][0]["message"]["tool_calls"]] == ["get_weather"]


def test_tool_call_streamed_without_leaking_markup(make_client):
    client = scripted_client(make_client, "Checking. " + CALL)
    chunks = sse_chunks(chat(client, tools=TOOLS, max_tokens=64, temperature=0, stream=True))
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert content == "Checking. " and "<tool_call>" not in content
    assert [(t["index"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_llama3_json_and_named_tool_choice(make_client):
    client = scripted_client(make_client, '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                             tool_call_parser="llama3_json")
    call = chat(client, tools=TOOLS, max_tokens=64, temperature=0).json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    args_only = scripted_client(make_client, '{"city": "Rome"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    msg = chat(args_only, tools=TOOLS, tool_choice=named, max_tokens=64, temperature=0).json()["choices"][0]["message"]
    assert msg["content"] is None and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}


def test_tools_reach_the_chat_template(make_client):
    template = kog.loader.ChatTemplate(
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    client = make_client(template=template)
    with_tools = chat(client, tools=TOOLS, max_tokens=1).json()["usage"]["prompt_tokens"]
    without = chat(client, max_tokens=1).json()["usage"]["prompt_tokens"]
    assert with_tools == without + len(TOK.encode("[tool get_weather]", add_special_tokens=False))


def test_assistant_tool_calls_and_tool_results_are_accepted(client):
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    r = client.post("/v1/chat/completions", json={"model": "kog", "messages": history, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_extreme_sampling_values_do_not_poison_the_batch(client):
    """Tiny temperatures sample greedily; a near-zero repetition penalty is refused (400), so
    no request can put a NaN into a step shared with others."""
    greedy = chat(client, max_tokens=4, temperature=0).json()["choices"][0]["message"]["content"]
    tiny = chat(client, max_tokens=4, temperature=1e-300, top_p=5e-324).json()
    assert tiny["choices"][0]["message"]["content"] == greedy
    r = chat(client, max_tokens=4, repetition_penalty=5e-324)
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"
