"""kog.structured_output grammar constraints: params, compile errors, masks, advance, jump-forward, rollback,
fork, draft masks, the sampler hook, and constrained speculative verification."""

import json

import pytest
import torch

import kog
from kog.sampler import SampleRow, sample
from kog.structured_output.grammar import batch_allowed, build_constraint, ll_tokenizer
from kog.structured_output.lark_check import unproductive_rules
from kog.speculation.params import SpeculativeParams
from kog.structured_output.params import StructuredOutputParams
from kog.speculation.verify import verify_greedy
from kog.testing.structured import default_tokenizer

S = StructuredOutputParams
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}}]
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
         "required": ["x", "y"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def text_of(tok, c):
    """The tokens a constraint allows now, decoded (for small allowed sets)."""
    return {tok.decode([t]) for t in c.allowed().nonzero().flatten().tolist()}


# ---- params -----------------------------------------------------------------------------------
def test_from_openai_maps_response_format_and_tools():
    assert S.from_openai() is None and S.from_openai({"type": "text"}) is None
    assert S.from_openai({"type": "json_object"}).json_object
    p = S.from_openai({"type": "json_schema", "json_schema": {"name": "pt", "schema": POINT, "strict": True}})
    assert p.kind == "json_schema" and p.json_schema == POINT and p.name == "pt"
    assert S.from_openai(tools=TOOLS).tool_choice == "auto"  # OpenAI's default with tools
    assert S.from_openai(tools=TOOLS, tool_choice="none") is None
    named = S.from_openai({"type": "json_object"}, TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named.kind == "tools" and named.forced_tool() == "add" and not named.json_object  # the call wins
    assert not S.from_openai(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).parallel_tool_calls
    both = S.from_openai({"type": "json_object"}, TOOLS, "auto")
    assert both.kind == "tools" and both.json_object


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"json_object": True, "regex": "a"}, "exactly one"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": [1]}, "JSON object"),
    ({"grammar": 3}, "must be a string"),
    ({"tool_choice": "auto", "json_object": True}, "needs tools"),
    ({"tools": []}, "non-empty list"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "auto"}, "name"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "auto"}, "duplicate"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "'mul'"),
    ({"tools": TOOLS, "tool_choice": "required", "json_object": True}, "cannot be combined"),
])
def test_bad_structured_params(kwargs, match):
    with pytest.raises(kog.InvalidRequest, match=match):
        S(**kwargs)


def test_sampling_params_carry_structured_and_speculative():
    p = kog.SamplingParams(structured={"json_schema": POINT}, speculative={"method": "draft", "num_tokens": 3})
    assert isinstance(p.structured, S) and isinstance(p.speculative, SpeculativeParams)
    assert kog.SamplingParams().structured is None and kog.SamplingParams().speculative is None
    with pytest.raises(kog.InvalidRequest, match="unknown fields"):
        kog.SamplingParams(structured={"schema": POINT})
    with pytest.raises(kog.InvalidRequest, match="structured"):
        kog.SamplingParams(structured="json")
    for bad, match in [({"method": "medusa"}, "method"), ({"num_tokens": 0}, "num_tokens"),
                       ({"num_tokens": 17}, "<= 16"), ({"ngram_min": 3, "ngram_max": 2}, "ngram_min")]:
        with pytest.raises(kog.InvalidRequest, match=match):
            kog.SamplingParams(speculative=bad)


# ---- compile errors: before any token ---------------------------------------------------------
@pytest.mark.parametrize("params, match", [
    (S(json_schema={"type": "strng"}), "Invalid type: strng"),
    (S(json_schema={"type": "integer", "minimum": 5, "maximum": 2}), "minimum .5. is greater than maximum .2."),
    (S(json_schema={"type": "array", "minItems": 3, "maxItems": 1}), "minItems"),
    (S(json_schema={"allOf": [{"type": "string"}, {"type": "integer"}]}), "Unsatisfiable"),
    (S(json_schema={"enum": []}), "anyOf is empty"),
    (S(json_schema={"not": {"type": "string"}, "x-guidance": {"lenient": False}}), r"Unimplemented keys: \[\"not\"\]"),
    (S(json_schema={"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}), "example.com"),
    (S(json_schema={"type": "string", "pattern": "[a-"}), "unclosed character class"),
    (S(regex="(ab"), "regex"),
    (S(grammar="start: foo"), 'unknown name: "foo"'),
    (S(grammar='start: "a" | <|nonexistent|>'), "unknown special token"),
    (S(grammar='start: "a" x\nx: "b" x'), "can never finish: rules 'start', 'x'"),
    (S(grammar='start: item+\nitem: "(" item ")"'), "can never finish: rules 'start', 'item'"),
    (S(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["a"],
                                                                            "properties": {"a": False}}}}],
       tool_choice="required"), "function 'f' parameters: .*required property 'a' is unsatisfiable"),
])
def test_invalid_or_unsatisfiable_grammars_are_invalid_requests(tok, params, match):
    with pytest.raises(kog.InvalidRequest, match=match) as e:
        build_constraint(tok, params)
    assert str(e.value).startswith(f"structured output ({params.kind}")


@pytest.mark.parametrize("grammar, stuck", [
    ('start: "a" x\nx: "b" x | "c"', []),
    ('start: x\nx: y\ny: x', ["start", "x", "y"]),
    ('start: "a" | x\nx: x "b"', ["x"]),  # x is dead but start can finish
    ('start: [x] y*\nx: x\ny: y', ["x", "y"]),
    ('start: x~0..2\nx: x', ["x"]),
    ('start: x~2\nx: "a" /[0-9]+/ <|im_end|> %json {"type": "object", "x": "}"} @sub', []),
    ('start: a\n   | b\na[lazy]: TEXT "<x>"\nb.2: "b" -> bee\nTEXT: /(.|\\n)*/', []),
    ("start: x\n%import common.WS", None),  # syntax the check does not model: no verdict
])
def test_unproductive_rules(grammar, stuck):
    assert unproductive_rules(grammar) == stuck


RELAXED = {  # keywords llguidance does not implement -> what its lenient mode reports
    "not": ({"type": "integer", "not": {"const": 3}}, 'Unimplemented keys: ["not"]'),
    "if/then/else": ({"type": "string", "if": {"maxLength": 2}, "then": {"pattern": "^a"}, "else": {}},
                     'Unimplemented keys: ["else", "if", "then"]'),
    "contains": ({"type": "array", "contains": {"const": 1}, "minContains": 2}, '["contains", "minContains"]'),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, '["dependentRequired"]'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^x"}}, '["propertyNames"]'),
    "uniqueItems over strings": ({"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                                 '["uniqueItems"]'),
    "unknown format": ({"type": "string", "format": "isbn"}, "Unknown format: isbn"),
}


@pytest.mark.parametrize("case", list(RELAXED))
def test_unimplemented_keywords_are_relaxed_and_reported(tok, case):
    schema, warning = RELAXED[case]
    answer = build_constraint(tok, S(json_schema={"type": "object", "properties": {"v": schema}}))
    call = build_constraint(tok, S(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": schema}, "x-guidance": {"whitespace_flexible": True}}}}],
        tool_choice="required"))
    for c in (answer, call, answer.fork()):
        assert len(c.relaxed) == 1 and warning in c.relaxed[0]
    assert build_constraint(tok, S(json_schema={"type": "object"})).relaxed == ()


def test_the_error_names_the_schema(tok):
    with pytest.raises(kog.InvalidRequest, match=r"json_schema 'point'"):
        build_constraint(tok, S(json_schema={"type": "strng"}, name="point"))


# ---- masks and advance ------------------------------------------------------------------------
def test_mask_allows_exactly_the_grammars_tokens(tok):
    c = build_constraint(tok, S(grammar='start: "yes" | "no"'))
    allowed = text_of(tok, c)
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in allowed)
    assert {"yes", "no"} <= allowed
    logits = torch.randn(tok.vocab_size)
    masked = c.mask_logits(logits)
    assert torch.equal(torch.isfinite(masked), c.allowed())
    assert torch.equal(masked[c.allowed()], logits[c.allowed()])
    c.advance(tok.token_to_id("yes"))
    assert c.is_accepting() and c.is_stopped()
    assert c.allowed().nonzero().flatten().tolist() == [tok.eos_token_id]


def test_padded_vocabulary_columns_are_never_allowed(tok):
    c = build_constraint(tok, S(json_object=True), vocab_size=tok.vocab_size + 64)
    assert c.allowed().shape == (tok.vocab_size + 64,) and not c.allowed()[tok.vocab_size:].any()
    with pytest.raises(kog.InvalidRequest, match="columns"):
        c.mask_logits(torch.zeros(tok.vocab_size))


def test_a_forbidden_token_raises_and_leaves_the_state_usable(tok):
    c = build_constraint(tok, S(json_schema=POINT))
    c.advance_many(tok.encode('{"x": 1'))
    with pytest.raises(kog.InvalidOperation, match="not allowed"):
        c.advance_many(tok.encode(', "z"'))
    assert c.num_tokens == len(tok.encode('{"x": 1'))
    c.advance_many(tok.encode(', "y": 2}') + [tok.eos_token_id])
    assert c.is_stopped()


def test_eos_only_where_the_grammar_accepts(tok):
    c = build_constraint(tok, S(json_schema={"type": "integer"}), eos_token_ids=(tok.eos_token_id, 0))
    assert not c.allowed()[tok.eos_token_id]
    c.advance_many(tok.encode("12"))
    assert c.allowed()[tok.eos_token_id] and c.allowed()[0] and c.allowed()[tok.encode("3")[0]]
    assert c.num_allowed([0]) == 1


def test_llguidance_tokenizer_is_built_once_per_tokenizer(tok):
    assert ll_tokenizer(tok) is ll_tokenizer(tok)
    assert ll_tokenizer(tok, (tok.eos_token_id, 0)) is not ll_tokenizer(tok)


# ---- jump-forward -----------------------------------------------------------------------------
def test_forced_tokens_of_a_named_tool_call(tok):
    c = build_constraint(tok, S(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}))
    forced = c.forced_tokens()
    assert tok.decode(forced) == '<tool_call>\n{"name": "add", "arguments": {"a":'
    assert c.num_tokens == 0  # not consumed
    c.advance_many(forced)
    assert c.forced_tokens() == []  # the model chooses the number
    c.advance_many(tok.encode(" 12,"))
    after_comma = tok.decode(c.forced_tokens())
    assert after_comma and ' "b":'.startswith(after_comma)


def test_forced_tokens_then_free_choice_then_stop(tok):
    c = build_constraint(tok, S(regex=r"The answer is [0-9]+\."))
    forced = c.forced_tokens()
    assert "The answer is".startswith(tok.decode(forced).strip()) and len(tok.decode(forced)) >= 10
    c.advance_many(forced)
    c.advance_many(tok.encode(tok.decode(forced) + " 42.")[len(forced):])
    assert c.is_accepting() and c.forced_tokens() == []


# ---- rollback and fork ------------------------------------------------------------------------
def test_rollback_restores_every_earlier_mask(tok):
    c = build_constraint(tok, S(json_schema=POINT))
    ids = tok.encode('{"x": 12, "y": -3}')
    masks = [c.allowed().clone()]
    for t in ids:
        c.advance(t)
        masks.append(c.allowed().clone())
    for n in (1, 3, len(ids)):
        c.rollback(n)
        assert torch.equal(c.allowed(), masks[len(ids) - n]) and c.num_tokens == len(ids) - n
        c.advance_many(ids[len(ids) - n:])
    with pytest.raises(kog.InvalidOperation, match="cannot roll back"):
        c.rollback(len(ids) + 1)


def test_forks_are_independent(tok):
    a = build_constraint(tok, S(json_schema=POINT))
    a.advance_many(tok.encode('{"x": 1'))
    b = a.fork()
    assert b.num_tokens == a.num_tokens and torch.equal(a.allowed(), b.allowed())
    a.advance_many(tok.encode(', "y": 2}'))
    assert a.is_accepting() and not b.is_accepting()
    b.advance_many(tok.encode('0, "y": 7}'))
    b.rollback(b.num_tokens)
    assert not b.is_accepting() and a.is_accepting()
    assert tok.decode(b.forced_tokens()) == '{"x":'


def test_compiled_grammars_are_cached_and_every_request_gets_its_own_state(tok):
    import time

    schema = {**POINT, "title": "cache test"}  # a grammar no other test compiled
    t0 = time.perf_counter()
    first = build_constraint(tok, S(json_schema=schema))
    t1 = time.perf_counter()
    second = build_constraint(tok, S(json_schema=schema))
    t2 = time.perf_counter()
    assert t2 - t1 < (t1 - t0) / 3
    assert first.matcher is not second.matcher
    first.advance_many(tok.encode('{"x": 1'))
    assert second.num_tokens == 0 and tok.decode(second.forced_tokens()) == '{"x":'
    third = build_constraint(tok, S(json_schema=schema))
    assert third.num_tokens == 0 and torch.equal(third.allowed(), second.allowed())
    assert build_constraint(tok, S(json_schema=schema), vocab_size=tok.vocab_size + 8).vocab_size == tok.vocab_size + 8


def test_batch_masks_equal_one_by_one_masks(tok):
    prefixes = ['{"x": 1', '{"', "", '{"x": 12, "y": 3}']
    fresh = [build_constraint(tok, S(json_schema=POINT)) for _ in prefixes]
    ref = [build_constraint(tok, S(json_schema=POINT)) for _ in prefixes]
    for a, b, text in zip(fresh, ref, prefixes):
        a.advance_many(tok.encode(text))
        b.advance_many(tok.encode(text))
    ref[1].allowed()  # a cached mask is reused, the others computed in parallel
    masks = batch_allowed(fresh + [ref[1]])
    assert masks.shape == (5, tok.vocab_size)
    for i, b in enumerate(ref + [ref[1]]):
        assert torch.equal(masks[i], b.allowed()), i
    with pytest.raises(kog.InvalidRequest, match="disagree"):
        batch_allowed([fresh[0], build_constraint(tok, S(json_object=True), vocab_size=tok.vocab_size + 1)])


# ---- the sampler hook -------------------------------------------------------------------------
def test_sampler_applies_the_constraint_after_penalties(tok):
    c = build_constraint(tok, S(grammar='start: "yes" | "no"'))
    logits = torch.randn(2, tok.vocab_size)
    logits[:, tok.token_to_id("maybe")] = 100.0
    logits[:, tok.token_to_id("no")] = 5.0
    greedy = kog.SamplingParams(temperature=0, logprobs=0)
    res = sample(logits, [SampleRow(greedy, [], [], constraint=c), SampleRow(greedy, [], [])])
    assert res.token_ids == [tok.token_to_id("no"), tok.token_to_id("maybe")]
    assert res.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[tok.token_to_id("no")]))
    g = torch.Generator().manual_seed(0)
    hot = kog.SamplingParams(temperature=2.0, top_k=5)
    draws = {sample(logits[:1], [SampleRow(hot, [], [], (), g, c)]).token_ids[0] for _ in range(15)}
    assert draws <= set(c.allowed().nonzero().flatten().tolist())


def test_the_grammar_wins_over_min_tokens(tok):
    c = build_constraint(tok, S(grammar='start: "yes"'))
    c.advance(tok.token_to_id("yes"))
    p = kog.SamplingParams(temperature=0, min_tokens=5)
    res = sample(torch.randn(1, tok.vocab_size), [SampleRow(p, [], [1], [tok.eos_token_id], None, c)])
    assert res.token_ids == [tok.eos_token_id]


# ---- speculative decoding under a grammar -----------------------------------------------------
def test_draft_masks_are_the_step_by_step_masks(tok):
    c = build_constraint(tok, S(json_schema=POINT))
    draft = tok.encode('{"x": 4')
    masks = c.draft_masks(draft)
    assert masks.shape == (len(draft) + 1, tok.vocab_size) and c.num_tokens == 0
    for i, t in enumerate(draft):
        assert torch.equal(masks[i], c.allowed())
        c.advance(t)
    assert torch.equal(masks[-1], c.allowed())
    c.rollback(c.num_tokens)
    with pytest.raises(kog.InvalidOperation):
        c.draft_masks(draft[:2] + tok.encode('"z'))
    assert c.num_tokens == 0 and c.num_allowed(draft[:2] + tok.encode('"z')) == 3  # {" x " but not z


def test_constrained_speculative_greedy_equals_constrained_greedy(tok):
    """A synthetic target (logits a fixed function of the last token) under a grammar: verifying
    drafts (some wrong, some forbidden) emits exactly what step-by-step constrained greedy emits."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(tok.vocab_size, 64, generator=g)
    proj = torch.randn(64, tok.vocab_size, generator=g)

    def target(last):
        return table[last] @ proj  # [V]

    schema = {"type": "object", "properties": {"a": {"enum": ["red", "green"]}, "b": {"type": "integer",
              "minimum": 0, "maximum": 999}}, "required": ["a", "b"], "additionalProperties": False}
    ref = build_constraint(tok, S(json_schema=schema))
    plain = []
    while not plain or plain[-1] != tok.eos_token_id:
        t = int(ref.mask_logits(target(plain[-1] if plain else 0)).argmax())
        ref.advance(t)
        plain.append(t)

    c = build_constraint(tok, S(json_schema=schema))
    out, rounds = [], 0
    while not out or out[-1] != tok.eos_token_id:
        # Draft: the true continuation with a corruption every third round (or garbage).
        draft = plain[len(out):len(out) + 4]
        if rounds % 3 == 2 and draft:
            draft[-1] = tok.encode("zz")[0]
        draft = draft[:c.num_allowed(draft)]  # forbidden draft tokens are cut first
        last = out[-1] if out else 0
        logits = torch.stack([target(t) for t in [last] + draft])  # [k + 1, V]
        v = verify_greedy(logits.masked_fill(~c.draft_masks(draft), float("-inf")), draft)
        tokens = v.tokens
        if tok.eos_token_id in tokens:  # the engine's stop check: nothing after EOS is emitted
            tokens = tokens[:tokens.index(tok.eos_token_id) + 1]
        c.advance_many(tokens)
        out += tokens
        rounds += 1
    assert out == plain and rounds < len(plain)
    assert json.loads(tok.decode(plain[:-1]))["a"] in ("red", "green")


# ---- tool-call grammar details ----------------------------------------------------------------
def test_one_call_when_parallel_tool_calls_is_off(tok):
    call = tok.encode('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    for choice, prefix in (("required", []), ("auto", tok.encode("Checking. "))):
        many = build_constraint(tok, S(tools=TOOLS, tool_choice=choice))
        many.advance_many(prefix + call)
        assert not many.is_stopped()  # another call (or text) may follow
        one = build_constraint(tok, S(tools=TOOLS, tool_choice=choice, parallel_tool_calls=False))
        one.advance_many(prefix + call)
        assert one.is_stopped() and one.allowed().nonzero().flatten().tolist() == [tok.eos_token_id]


def test_call_tags_that_are_special_tokens_are_matched_as_tokens():
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from kog.loader.tokenizer import Tokenizer
    from kog.testing.tiny_models import tiny_tokenizer

    base = tiny_tokenizer()
    hf = HFTokenizer.from_str(base.hf.to_str())
    hf.add_special_tokens([AddedToken("<tool_call>", special=True, normalized=False),
                           AddedToken("</tool_call>", special=True, normalized=False)])
    qtok = Tokenizer(hf, bos_token=base.bos_token, eos_token=base.eos_token)
    open_id, close_id = qtok.token_to_id("<tool_call>"), qtok.token_to_id("</tool_call>")
    c = build_constraint(qtok, S(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}))
    forced = c.forced_tokens()
    assert forced[0] == open_id and qtok.decode(forced[1:]).startswith('\n{"name": "now"')
    auto = build_constraint(qtok, S(tools=TOOLS, tool_choice="auto"))
    assert auto.allowed()[open_id]
    auto.advance_many(qtok.encode("hi <tool_call>", add_special_tokens=False))
    assert qtok.decode(auto.forced_tokens()).startswith('\n{"name": "')
    auto.advance_many(qtok.encode('\n{"name": "now", "arguments": {}}\n', add_special_tokens=False))
    assert auto.allowed().nonzero().flatten().tolist() == [close_id]
