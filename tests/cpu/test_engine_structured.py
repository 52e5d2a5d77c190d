"""Structured output through the engine (kog.engine.structured) on the fake model of
kog.testing.fake_runner: constrained outputs validate, jump-forward computes forced tokens in one
forward and matches a reference loop token for token, n > 1 branches keep their own grammar
states, and invalid requests fail before any token."""

import json
import re

import pytest
import torch

import kog
from kog.engine import EngineConfig, LLMEngine
from kog.llm import LLM
from kog.loader import ChatTemplate
from kog.sampler import SampleRow, make_generator, sample
from kog.sampling_params import SamplingParams
from kog.structured_output.grammar import build_constraint
from kog.structured_output.params import StructuredOutputParams
from kog.testing.fake_runner import FakeRunner, context_logits
from kog.testing.structured import PERSON_SCHEMA as PERSON
from kog.testing.tiny_models import CHATML_TEMPLATE, tiny_tokenizer

jsonschema = pytest.importorskip("jsonschema")

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}]


def make_engine(num_blocks=256, budget=64, max_num_seqs=8):
    runner = FakeRunner(TOK.vocab_size, num_blocks, block_size=4)
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return LLMEngine(runner, TOK, [EOS], 512, cfg), runner


def run(engine, requests):
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    for _ in range(5000):
        if not engine.has_unfinished():
            return {rid: engine.get_output(rid) for rid, _, _ in requests}
        engine.step()
    pytest.fail("engine made no progress")


def reference(prompt, params, index=0):
    """The engine's contract on the fake model, one token at a time: sample under the grammar,
    then (with jump-forward) append whatever the grammar forces; stop at EOS or max_tokens."""
    c = build_constraint(TOK, params.structured, (EOS,), TOK.vocab_size)
    gen = make_generator(None if params.seed is None else params.seed + index)
    out = []
    while len(out) < params.max_tokens:
        logits = context_logits(list(prompt) + out, TOK.vocab_size)[None]
        t = sample(logits, [SampleRow(params, prompt, out, [EOS], gen, c)]).token_ids[0]
        c.advance(t)
        out.append(t)
        if t == EOS:
            break
        for f in c.forced_tokens() if params.structured.jump_forward else []:
            if len(out) == params.max_tokens:
                break
            c.advance(f)
            out.append(f)
    return out


def prompt(seed, n=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TOK.vocab_size, (n,), generator=g).tolist()


def body(out):
    """The JSON text of an output (its token ids end with EOS, which has no text)."""
    assert out.token_ids[-1] == EOS and out.finish_reason == "stop", out
    return json.loads(out.text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_through_llm_generate_validate(temperature):
    engine, _ = make_engine()
    llm = LLM.from_engine(engine, TOK)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=200,
                             structured=StructuredOutputParams(json_schema=PERSON)) for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": prompt(i)} for i in range(6)], params)
    for o in outs:
        jsonschema.validate(body(o.outputs[0]), PERSON)
    assert engine.kv.stats()["blocks_used"] == 0


@pytest.mark.parametrize("jump_forward", [False, True])
def test_engine_matches_the_reference_loop_token_for_token(jump_forward):
    engine, _ = make_engine(budget=16)
    reqs = [(f"r{i}", prompt(10 + i), SamplingParams(
        temperature=[0.0, 0.8][i % 2], seed=i, max_tokens=[200, 25][i // 4],
        structured=StructuredOutputParams(json_schema=PERSON, jump_forward=jump_forward))) for i in range(8)]
    outs = run(engine, reqs)
    for rid, p, params in reqs:
        assert outs[rid].outputs[0].token_ids == reference(p, params), rid
    assert outs["r7"].outputs[0].finish_reason == "length"


def test_jump_forward_computes_forced_runs_in_one_forward():
    results = {}
    for jf in (False, True):
        engine, runner = make_engine()
        params = SamplingParams(temperature=0, max_tokens=200,
                                structured=StructuredOutputParams(tools=WEATHER, tool_choice="required",
                                                                  parallel_tool_calls=False, jump_forward=jf))
        out = run(engine, [("a", prompt(3), params)])["a"]
        results[jf] = out, runner.calls
    (plain, _), (fast, fast_calls) = results[False], results[True]
    n = len(plain.outputs[0].token_ids)
    assert plain.num_forward_passes == n  # the prompt's forward, then one per token but the last (EOS)
    forced = len(TOK.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "'))
    assert fast.num_forward_passes <= len(fast.outputs[0].token_ids) - forced + 2
    assert fast_calls["decode"] + fast_calls["prefill"] == fast.num_forward_passes
    text = fast.outputs[0].text
    assert text.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "'), text
    call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
    jsonschema.validate(call["arguments"], WEATHER[0]["function"]["parameters"])


def test_n_branches_keep_independent_grammar_states():
    engine, _ = make_engine()
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=200,
                            structured=StructuredOutputParams(json_schema=PERSON))
    p = prompt(5)
    outs = run(engine, [("a", p, params)])["a"].outputs
    assert len(outs) == 4 and len({tuple(o.token_ids) for o in outs}) > 1
    for o in outs:
        jsonschema.validate(body(o), PERSON)
        assert o.token_ids == reference(p, params, o.index)
    assert engine.kv.stats()["blocks_used"] == 0


def test_invalid_schema_is_rejected_before_any_token():
    engine, runner = make_engine()
    bad = StructuredOutputParams(json_schema={"type": "integer", "minimum": 5, "maximum": 2})
    with pytest.raises(kog.InvalidRequest, match="minimum"):
        engine.add_request("a", prompt(0), SamplingParams(structured=bad))
    assert not engine.has_unfinished() and runner.calls["prefill"] == runner.calls["decode"] == 0
    engine.add_request("a", prompt(0), SamplingParams(max_tokens=2))  # the id was not taken


def test_the_grammar_ends_the_sequence_even_under_ignore_eos_and_min_tokens():
    engine, _ = make_engine()
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, min_tokens=250,
                            structured=StructuredOutputParams(regex=r"(yes|no)"))
    out = run(engine, [("a", prompt(1), params)])["a"].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and out.stop_reason == EOS


def test_chat_with_tool_choice_builds_the_tool_call_constraint():
    engine, _ = make_engine()
    llm = LLM.from_engine(engine, TOK, ChatTemplate(CHATML_TEMPLATE))
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=200), tools=WEATHER, tool_choice="required")
    text = out[0].outputs[0].text
    assert text.startswith("<tool_call>\n") and text.endswith("</tool_call>"), text
    with pytest.raises(kog.InvalidRequest, match="needs tools"):
        llm.chat(msgs, SamplingParams(), tool_choice="required")
    with pytest.raises(kog.InvalidRequest, match="leave SamplingParams.structured unset"):
        llm.chat(msgs, SamplingParams(structured={"json_object": True}), tools=WEATHER,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    free = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=5), tools=WEATHER)  # no tool_choice: free
    assert len(free[0].outputs[0].token_ids) == 5


SEARCH = [{"type": "function", "function": {"name": "search", "parameters": {  # nothing bounds the strings
    "type": "object", "properties": {"query": {"type": "string"}, "lang": {"type": "string"}},
    "required": ["query", "lang"]}}}]


def test_calls_close_before_max_tokens():
    """Random strings never end on their own; near max_tokens the engine draws again each token that
    would leave the call no room to finish (kog.structured_output.call_budget), so every reply has a valid call."""
    engine, _ = make_engine()
    llm = LLM.from_engine(engine, TOK, ChatTemplate(CHATML_TEMPLATE))
    params = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=70)
    [out] = llm.chat([{"role": "user", "content": "search it"}], params, tools=SEARCH, tool_choice="required")
    for o in out.outputs:
        calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", o.text, re.S)
        assert calls, o.text
        for call in calls:
            jsonschema.validate(json.loads(call)["arguments"], SEARCH[0]["function"]["parameters"])
