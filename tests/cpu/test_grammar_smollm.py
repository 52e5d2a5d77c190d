"""Structured output with the real SmolLM2-135M-Instruct: greedy decoding under a JSON schema and
a forced tool call, with and without jump-forward (forced tokens fed as one prefill chunk)."""

import json

import numpy as np
import pytest
import torch

from kog.loader import load_model
from kog.models import ModelRunner, PrefillChunk
from kog.structured_output.grammar import build_constraint
from kog.structured_output.params import StructuredOutputParams

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

BS = 16
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"enum": ["Paris", "London", "Tokyo", "other"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "maxLength": 24},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                 "required": ["city", "unit"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def smollm():
    model = load_model(dtype=torch.float32)
    return model, ModelRunner(model, num_kv_blocks=32, block_size=BS)


def constrained_greedy(runner, prompt, constraint, eos, max_tokens=80, jump_forward=False):
    """One sequence at blocks 0..; returns (output ids without EOS, model forward calls)."""
    table = np.arange(32, dtype=np.int32)

    def chunk(tokens, start):
        pos = np.arange(start, start + len(tokens))
        return PrefillChunk(tokens, start, table, table[pos // BS].astype(np.int64) * BS + pos % BS)

    logits, calls, out = runner.prefill([chunk(prompt, 0)])[0], 1, []
    while len(out) < max_tokens:
        forced = constraint.forced_tokens() if jump_forward else []
        if forced:  # jump-forward: the grammar's tokens, no sampling, one forward for all of them
            constraint.advance_many(forced)
            logits = runner.prefill([chunk(forced, len(prompt) + len(out))])[0]
            out += forced
            calls += 1
            continue
        token = int(constraint.mask_logits(logits).argmax())
        constraint.advance(token)
        if token == eos:
            return out, calls
        p = len(prompt) + len(out)
        out.append(token)
        logits = runner.decode(np.array([token]), np.array([p]), table[None], np.array([p + 1], np.int32),
                               chunk([token], p).slots)[0]
        calls += 1
    pytest.fail(f"no EOS within {max_tokens} tokens")


def chat(model, text):
    rendered = model.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return model.tokenizer.encode(rendered, add_special_tokens=False)


def test_json_schema_answer_validates(smollm):
    model, runner = smollm
    tok = model.tokenizer
    c = build_constraint(tok, StructuredOutputParams(json_schema=PERSON), model.stop_token_ids, runner.vocab_size)
    out, _ = constrained_greedy(runner, chat(model, "Describe a fictional person as JSON with name, age, city."),
                                c, tok.eos_token_id, jump_forward=True)
    jsonschema.validate(json.loads(tok.decode(out)), PERSON)


def test_forced_tool_call_validates_and_jump_forward_saves_forwards(smollm):
    model, runner = smollm
    tok = model.tokenizer
    params = StructuredOutputParams(tools=WEATHER, tool_choice="required", parallel_tool_calls=False)
    prompt = chat(model, "What is the weather in Paris, in celsius?")
    results = {}
    for jf in (False, True):
        c = build_constraint(tok, params, model.stop_token_ids, runner.vocab_size)
        results[jf] = constrained_greedy(runner, prompt, c, tok.eos_token_id, jump_forward=jf)
    for out, _ in results.values():
        text = tok.decode(out)
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
        call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
        assert call["name"] == "get_weather"
        jsonschema.validate(call["arguments"], WEATHER[0]["function"]["parameters"])
    assert results[True][1] < results[False][1] - 5  # the call's fixed text costs one forward, not one per token
