"""The engine with the real SmolLM2-135M-Instruct: a forced tool call through kog.LLM.chat gives
the same tokens with jump-forward and n-gram speculation as plain constrained greedy decoding, in
far fewer forwards; greedy n-gram speculation equals plain greedy on free text."""

import json

import pytest

import kog
from kog.speculation.params import SpeculativeParams
from kog.structured_output.params import StructuredOutputParams

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

FLIGHTS = [{"type": "function", "function": {"name": "search_flights", "parameters": {
    "type": "object", "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"}, "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "cabin": {"enum": ["economy", "business", "first"]}},
    "required": ["origin", "destination", "passengers", "cabin"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def llm():
    return kog.LLM(max_num_seqs=4)


def test_forced_tool_call_same_tokens_fewer_forwards(llm):
    msgs = [{"role": "user", "content": "Find a business class flight from CDG to JFK for two people."}]
    outs = {}
    for jf, spec in ((False, None), (True, None), (True, SpeculativeParams("ngram", 4))):
        p = kog.SamplingParams(temperature=0, max_tokens=120, speculative=spec,
                               structured=StructuredOutputParams(tools=FLIGHTS, tool_choice="required",
                                                                 parallel_tool_calls=False, jump_forward=jf))
        outs[jf, spec is not None] = llm.generate({"prompt_token_ids": llm.encode_chat(msgs, FLIGHTS)}, p)[0]
    plain = outs[False, False]
    text = plain.outputs[0].text
    call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
    jsonschema.validate(call["arguments"], FLIGHTS[0]["function"]["parameters"])
    n = len(plain.outputs[0].token_ids)
    assert plain.num_forward_passes == n
    for key in ((True, False), (True, True)):
        assert outs[key].outputs[0].token_ids == plain.outputs[0].token_ids, key
        assert outs[key].num_forward_passes <= 0.5 * n, (key, outs[key].num_forward_passes, n)


def test_greedy_ngram_speculation_equals_plain_greedy(llm):
    prompts = [f"Repeat this list exactly: {', '.join(words)}. Again: {', '.join(words[:2])}"
               for words in (["red", "green", "blue", "cyan"], ["one", "two", "three", "four"],
                             ["Paris", "London", "Tokyo", "Rome"], ["alpha", "beta", "gamma", "delta"])]
    plain = llm.generate(prompts, kog.SamplingParams(temperature=0, max_tokens=24))
    fast = llm.generate(prompts, kog.SamplingParams(temperature=0, max_tokens=24,
                                                    speculative=SpeculativeParams("ngram", 4)))
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.num_forward_passes for o in fast) < sum(o.num_forward_passes for o in plain)
