"""Constrained sampling always yields valid output: 60 random JSON schemas, JSON objects, regexes
and tool calls, sampled at temperature 1.0 from random logits over SmolLM2's real 49k vocabulary
(only its tokenizer is loaded), through kog.sampler with the constraint on the row."""

import json
import random
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")

from kog.structured_output.grammar import build_constraint  # noqa: E402
from kog.structured_output.params import StructuredOutputParams  # noqa: E402
from kog.testing.structured import default_tokenizer, random_schema, sample_constrained  # noqa: E402

N_SCHEMAS = 60


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Per-token torch work on a 49k row is tiny; threads only add contention on shared CPUs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def run(tok, params, seed, jump_forward=False, bias=None, max_tokens=400):
    c = build_constraint(tok, params, eos_token_ids=(tok.eos_token_id,))
    out, stopped = sample_constrained(c, {tok.eos_token_id}, torch.Generator().manual_seed(seed), max_tokens,
                                      jump_forward, bias)
    assert stopped, f"no EOS within {max_tokens} tokens: {tok.decode(out)!r}"
    return tok.decode(out)


def test_random_schemas_always_validate(tok):
    rng = random.Random(2024)
    kinds = set()
    for i in range(N_SCHEMAS):
        schema = random_schema(rng)
        text = run(tok, StructuredOutputParams(json_schema=schema), seed=i, jump_forward=i % 2 == 1)
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            pytest.fail(f"schema {i}: {json.dumps(schema)}\noutput {text!r}\n{e}")
        kinds |= set(re.findall(r'"(pattern|enum|minimum|maxItems|exclusiveMinimum|minLength|null|boolean)"',
                                json.dumps(schema)))
    assert len(kinds) == 8, kinds  # every feature was exercised


def test_compact_separators_unless_any_whitespace(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    for seed in range(3):
        text = run(tok, StructuredOutputParams(json_schema=schema), seed)
        assert re.fullmatch(r'\{"a": -?\d+, "b": (true|false)\}', text), text
    flexible = [run(tok, StructuredOutputParams(json_schema=schema, any_whitespace=True), seed, max_tokens=2000)
                for seed in range(3)]
    assert all(json.loads(t).keys() == {"a", "b"} for t in flexible)


def test_json_object(tok):
    # Unbounded grammar: a bias toward closing characters makes random sampling end. The logits
    # are 3 x N(0, 1) over 49k tokens (max ~12), so the bias must be of that size to end surely.
    bias = torch.zeros(tok.vocab_size)
    bias[[tok.token_to_id(t) for t in ['"', "}", "]", '"}']]] = 12.0
    for seed in range(4):
        assert isinstance(json.loads(run(tok, StructuredOutputParams(json_object=True), seed, bias=bias)), dict)


@pytest.mark.parametrize("regex", [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{0,5}( [a-z]{1,5}){0,3}\."])
def test_regex(tok, regex):
    for seed in range(3):
        text = run(tok, StructuredOutputParams(regex=regex), seed)
        assert re.fullmatch(regex, text), text


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def check_calls(text, names):
    calls = CALL.findall(text)
    assert calls and "".join(f"<tool_call>\n{c}\n</tool_call>\n" for c in calls).rstrip("\n") == text.strip(), text
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in calls:
        call = json.loads(c)
        assert list(call) == ["name", "arguments"] and call["name"] in names
        jsonschema.validate(call["arguments"], schemas[call["name"]])
    return calls


def test_tool_choice_required_and_named(tok):
    for seed in range(6):
        check_calls(run(tok, StructuredOutputParams(tools=TOOLS, tool_choice="required"), seed,
                        jump_forward=seed % 2 == 0), {"get_weather", "add"})
        named = {"type": "function", "function": {"name": "add"}}
        check_calls(run(tok, StructuredOutputParams(tools=TOOLS, tool_choice=named), seed), {"add"})


def test_tool_choice_auto_constrains_only_after_the_trigger(tok):
    params = StructuredOutputParams(tools=TOOLS, tool_choice="auto")
    c = build_constraint(tok, params)
    assert c.is_accepting() and c.allowed().sum() > 0.99 * tok.vocab_size  # free text, EOS allowed
    c.advance_many(tok.encode("Let me look that up. <tool_call>"))
    assert not c.is_accepting()
    g, out = torch.Generator().manual_seed(0), []
    while "\n</tool_call>" not in tok.decode(out):  # one token at a time; then the text is free again
        new, stopped = sample_constrained(c, {tok.eos_token_id}, g, max_tokens=1)
        assert not stopped and len(out) < 300
        out += new
    text = "<tool_call>" + tok.decode(out)
    check_calls(text[:text.index("\n</tool_call>") + len("\n</tool_call>")], {"get_weather", "add"})
    assert c.is_accepting() and c.allowed().sum() > 0.99 * tok.vocab_size


COLORS = ["red", "green", "blue", "cyan", "black"]
UNIQUE = {  # uniqueItems over enum items: every ordering enforced (5 values), the enum's order (8 values)
    "orderings": {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": COLORS},
                                                              "uniqueItems": True, "minItems": 2}},
                  "required": ["colors"], "additionalProperties": False},
    "enum order": {"type": "array", "items": {"type": "integer", "enum": [1, 2, 3, 4, 5, 6, 7, 8]},
                   "uniqueItems": True, "minItems": 3},
}


@pytest.mark.parametrize("case", list(UNIQUE))
def test_unique_items_over_an_enum_never_repeat(tok, case):
    schema, seen_orders = UNIQUE[case], set()
    for seed in range(40):
        value = json.loads(run(tok, StructuredOutputParams(json_schema=schema), seed, jump_forward=seed % 2 == 0))
        jsonschema.validate(value, schema)  # jsonschema implements uniqueItems
        items = value["colors"] if case == "orderings" else value
        assert len(set(items)) == len(items)
        seen_orders.add(tuple(items) == tuple(sorted(items, key=COLORS.index if case == "orderings" else int)))
    assert seen_orders == ({True, False} if case == "orderings" else {True})


def test_unique_items_in_tool_parameters(tok):
    params = {"type": "object", "$defs": {"Color": {"enum": COLORS}},
              "properties": {"colors": {"type": "array", "items": {"$ref": "#/$defs/Color"}, "uniqueItems": True}},
              "required": ["colors"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "paint", "parameters": params}}]
    for seed in range(10):
        [call] = CALL.findall(run(tok, StructuredOutputParams(tools=tools, tool_choice="required",
                                                              parallel_tool_calls=False), seed))
        args = json.loads(call)["arguments"]
        jsonschema.validate(args, params)
        assert len(set(args["colors"])) == len(args["colors"])
