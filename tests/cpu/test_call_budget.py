"""A constrained tool call is closed before max_tokens cuts it (kog.structured_output.call_budget, through the
engine's hooks in kog.engine.structured), on SmolLM2's real 49k vocabulary (tokenizer only) with
random logits at temperature 1.0, which write JSON strings without end: every budget from a
shortest call up gives a complete, valid call, where unchecked sampling loses it; a model's own
tokens are kept whenever the call can still end; the scanner and the route on their own."""

import json
import random
from types import SimpleNamespace

import pytest
import torch

from kog.engine import structured
from kog.sampler import SampleRow, sample
from kog.sampling_params import SamplingParams
from kog.server.tool_parsers import parse_tool_calls
from kog.structured_output.call_budget import WINDOW, JsonScan
from kog.structured_output.grammar import build_constraint
from kog.structured_output.params import StructuredOutputParams
from kog.testing.structured import default_tokenizer

jsonschema = pytest.importorskip("jsonschema")

TICKET = {"type": "object", "properties": {  # realistic: nothing bounds a string or an array
    "title": {"type": "string"}, "description": {"type": "string"},
    "priority": {"enum": ["low", "medium", "high"]}, "labels": {"type": "array", "items": {"type": "string"}},
    "due": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    "assignee": {"type": "object", "properties": {"team": {"enum": ["web", "mobile"]}, "user": {"type": "string"}},
                 "required": ["team", "user"]}},
    "required": ["title", "priority", "due", "assignee"]}
TOOLS = [{"type": "function", "function": {"name": "create_ticket", "parameters": TICKET}}]


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def constraint(tok, tool_choice="required"):
    return build_constraint(tok, StructuredOutputParams(tools=TOOLS, tool_choice=tool_choice),
                            eos_token_ids=(tok.eos_token_id,))


def generate(tok, c, max_tokens, seed, check=True, prefix="", logits=None):
    return tok.decode(generate_ids(tok, c, max_tokens, seed, check, prefix, logits))


def generate_ids(tok, c, max_tokens, seed, check=True, prefix="", logits=None):
    """The engine's step in miniature, with its budget hooks: forced tokens appended (cut by
    max_tokens), EOS-only between calls when no new call fits, a sampled token that leaves no room
    to close its call drawn again; random logits at temperature 1.0 unless `logits(out)` is given.
    Returns the output ids, without EOS (prefix: the output's start, already consumed by c)."""
    gen, out = torch.Generator().manual_seed(seed), tok.encode(prefix)
    seq = SimpleNamespace(constraint=c, output_ids=out, num_tokens=0,
                          params=SamplingParams(temperature=1.0, max_tokens=max_tokens))
    row = lambda s: SampleRow(s.params, [], s.output_ids, (), gen, s.constraint)  # noqa: E731
    while len(out) < max_tokens:
        forced = c.forced_tokens()[:max_tokens - len(out)]
        if forced:
            c.advance_many(forced)
            out += forced
            continue
        rows = 3.0 * torch.randn(1, c.vocab_size, generator=gen) if logits is None else logits(out)[None]
        if check:
            structured.before_sampling([seq], 10 ** 6)
        result = sample(rows, [row(seq)])
        if check:
            structured.keep_calls_in_budget([seq], rows, result, row, 10 ** 6)
        c.advance(result.token_ids[0])
        if result.token_ids[0] == tok.eos_token_id:
            break
        out.append(result.token_ids[0])
    return out


def valid_calls(text):
    calls = parse_tool_calls(text, "hermes").calls
    for call in calls:
        assert call.name == "create_ticket"
        jsonschema.validate(json.loads(call.arguments), TICKET)
    return calls


@pytest.mark.parametrize("max_tokens", [90, 120, 200])
def test_every_budget_from_a_shortest_call_up_gives_a_valid_call(tok, max_tokens):
    need = constraint(tok).budget.call_need
    assert 40 < need < 90  # the shortest call, forced text included
    lost = 0
    for seed in range(4):
        assert valid_calls(generate(tok, constraint(tok), max_tokens, seed)), seed
        lost += not valid_calls(generate(tok, constraint(tok), max_tokens, seed, check=False))
    assert lost >= 2  # the control: unchecked, random strings run past the budget


def test_auto_calls_close_too(tok):
    c = constraint(tok, "auto")
    c.advance_many(tok.encode("Sure.<tool_call>"))
    text = generate(tok, c, 100, seed=1, prefix="Sure.<tool_call>")
    assert valid_calls(text) and parse_tool_calls(text, "hermes").content.startswith("Sure.")  # free text after


def test_json_scan():
    s = JsonScan()
    assert s.feed(b'\n{"a": "x\\"}{[", "b": [1, {') is None
    assert (s.stack, s.in_string, s.closer()) == ([ord("{"), ord("["), ord("{")], False, ord("}"))
    assert s.feed(b'"c": "') is None and s.closer() == ord('"')
    s.feed(b"\\")
    assert s.closer() is None  # right after a backslash: nothing closes
    data = b'n"}]} tail'
    assert s.feed(data) == data.index(b" tail") and s.stack == []


def test_json_scan_equals_a_byte_by_byte_scan_fed_in_pieces():
    def reference(data):
        stack, in_string, escaped = [], False, False
        for i, b in enumerate(data):
            if in_string:
                escaped, in_string = (False, True) if escaped else (b == 0x5C, b != 0x22)
            elif b == 0x22:
                in_string = True
            elif b in b"{[":
                stack.append(b)
            elif b in b"}]" and stack:
                stack.pop()
                if not stack:
                    return i + 1, stack, in_string, escaped
        return None, stack, in_string, escaped

    rng = random.Random(0)
    for _ in range(20000):
        data = bytes(rng.choice(b'ab"\\{}[] ') for _ in range(rng.randint(0, 14)))
        s, closed, prev = JsonScan(), None, 0
        for cut in sorted(rng.randint(0, len(data)) for _ in range(rng.randint(0, 3))) + [len(data)]:
            closed, prev = s.feed(data[:cut], prev), cut
            if closed is not None:
                break
        assert (closed, s.stack, s.in_string, s.escaped) == reference(data), data


def test_a_model_that_fits_is_left_alone(tok):
    """A model whose call fits in max_tokens, with the slack the route may take beyond the
    shortest call (it can add an optional key), writes it token for token; short of its length,
    the call is still complete and valid, closed sooner."""
    own = ('<tool_call>\n{"name": "create_ticket", "arguments": {"title": "Login page crashes on Safari when the user '
           'submits the form twice in a row after the session has expired", "priority": "high", "due": "2025-03-14", '
           '"assignee": {"team": "web", "user": "ana"}}}\n</tool_call>')

    def model(out):  # by far prefers the next token of its own text
        row, done = torch.zeros(tok.vocab_size), tok.decode(out)
        row[tok.encode(own[len(done):])[0] if len(done) < len(own) else tok.eos_token_id] = 40.0
        return row

    n = len(generate_ids(tok, constraint(tok), 10 ** 4, 0, logits=model)) + 1  # its tokens and EOS
    assert generate(tok, constraint(tok), 10 ** 4, 0, logits=model) == own
    assert generate(tok, constraint(tok), n + 16, 0, logits=model) == own
    squeezed = generate(tok, constraint(tok), n - 8, 0, logits=model)
    assert squeezed != own and valid_calls(squeezed) and squeezed.startswith(own[:own.index("crashes")])


def test_a_token_fits_while_the_route_still_ends_in_time(tok):
    c = constraint(tok)
    head = tok.encode('<tool_call>\n{"name": "create_ticket", "arguments": {"title": "Login page ')
    c.advance_many(head)
    need, first = c.budget.route(c.matcher.deep_copy(), c.budget.open_call(tok.decode(head).encode()), WINDOW)
    assert tok.decode([first]) == '"' and 20 < need < 90
    word = tok.encode("crash")[0]  # text inside the string: the route after it is as long
    # room for the token, the route after it and EOS (tool_choice "required": the reply is calls)
    assert c.budget.fits(c.matcher, head, word, need + 2) and not c.budget.fits(c.matcher, head, word, need + 1)
    assert c.budget.fits(c.matcher, head, first, need + 1)  # closing the string shortens it
    closing = c.budget.closing(c.matcher, c.allowed(), head).nonzero().flatten().tolist()
    assert first in closing and len(closing) > 1 and c.allowed()[closing].all()
    assert all(tok.decode([t]).lstrip().startswith('"') and not tok.decode([t]).strip('"}] ') for t in closing)
    assert c.budget.closing(c.matcher, c.allowed(), head, closers=False).nonzero().flatten().tolist() == [first]
    assert c.budget.fits(c.matcher, head, word, WINDOW + 1)  # outside the window nothing is checked


def test_the_route_never_ends_past_the_budget(tok):
    """After every checked token, the call can still end within max_tokens; tokens are redrawn."""
    for seed in range(2):
        c, out, gen = constraint(tok), [], torch.Generator().manual_seed(seed)
        seq = SimpleNamespace(constraint=c, output_ids=out, num_tokens=0,
                              params=SamplingParams(temperature=1.0, max_tokens=120))
        row = lambda s: SampleRow(s.params, [], s.output_ids, (), gen, s.constraint)  # noqa: E731
        ends, redrawn = [], 0
        while not c.is_accepting():
            forced = c.forced_tokens()
            if forced:
                c.advance_many(forced)
                out += forced
                continue
            rows = 3.0 * torch.randn(1, c.vocab_size, generator=gen)
            result = sample(rows, [row(seq)])
            drawn = result.token_ids[0]
            structured.keep_calls_in_budget([seq], rows, result, row, 10 ** 6)
            redrawn += result.token_ids[0] != drawn
            c.advance(result.token_ids[0])
            out.append(result.token_ids[0])
            scan = c.budget.open_call(c.budget.ll.decode_bytes(out))
            if scan is not None:  # where the call would end by the route
                ends.append(c.budget.route(c.matcher.deep_copy(), scan, WINDOW)[0] + len(out))
        assert redrawn and max(ends) <= 120 and len(out) <= 120
        assert valid_calls(tok.decode(out))


def test_a_marker_inside_a_string_is_text(tok):
    budget = constraint(tok).budget
    inside = b'<tool_call>\n{"name": "create_ticket", "arguments": {"title": "see <tool_call> and </tool_call> '
    assert budget.open_call(inside).closer() == ord('"')
    assert budget.open_call(inside + b'"}}\n</tool_call>\n') is None
    assert budget.open_call(b"plain text") is None


def test_between_calls_only_eos_once_another_call_would_not_fit(tok):
    call = '<tool_call>\n{"name": "create_ticket", "arguments": {"title": "a", "priority": "low", "due": ' \
           '"2025-01-01", "assignee": {"team": "web", "user": "b"}}}\n</tool_call>'
    ids = tok.encode(call)
    for choice in ("required", "auto"):
        c = constraint(tok, choice)
        c.advance_many(ids)
        budget = c.budget
        assert c.is_accepting()
        if choice == "required":
            only_eos = budget.before_sampling(c.matcher, c.allowed(), ids, budget.call_need + 1)
            assert only_eos.nonzero().flatten().tolist() == [tok.eos_token_id]
            assert budget.before_sampling(c.matcher, c.allowed(), ids, budget.call_need + 2) is None
        else:  # free text may follow a call: nothing to check
            assert budget.call_need is None and budget.before_sampling(c.matcher, c.allowed(), ids, 40) is None
        c.advance_many(tok.encode("\n" + call))  # the grammar lets the reply end after any complete call
        assert c.is_accepting() and c.allowed()[tok.eos_token_id]
