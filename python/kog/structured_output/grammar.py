"""Grammar-constrained decoding: one `Constraint` per sequence, backed by an llguidance matcher.

    constraint = build_constraint(tokenizer, StructuredOutputParams(json_schema=schema))
    logits = constraint.mask_logits(logits)     # disallowed tokens -> -inf, before sampling
    constraint.advance(token)                   # after sampling
    forced = constraint.forced_tokens()         # jump-forward: tokens the grammar forces next

The llguidance tokenizer (the vocabulary as byte strings plus a token trie, ~0.6 s to build for
a 49k vocabulary) is built once per Kog tokenizer and shared by every constraint.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections import OrderedDict
from typing import Sequence

import llguidance as llg
import numpy as np
import torch

from kog.errors import InvalidOperation, InvalidRequest
from kog.loader.tokenizer import Tokenizer
from kog.structured_output.call_budget import CallBudget
from kog.structured_output.formats import HERMES, LENIENT, ToolCallFormat, lark_grammar, parameters_schema
from kog.structured_output.lark_check import unproductive_rules
from kog.structured_output.params import StructuredOutputParams

log = logging.getLogger("kog.structured_output")
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, dict[tuple, llg.LLTokenizer]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
# Compiled grammars, most recently used last: agents send the same tools and schemas every turn.
# NOTE: keyed by id() of the LLTokenizer; the cached Constraint holds it, so the id stays unique.
_COMPILED: OrderedDict[tuple[int, int, str], Constraint] = OrderedDict()
COMPILED_CACHE_SIZE = 128
_EXECUTOR: llg.LLExecutor | None = None  # llguidance's thread pool for batch_allowed, made on first use


def ll_tokenizer(tokenizer: Tokenizer, eos_token_ids: tuple[int, ...] = ()) -> llg.LLTokenizer:
    """The llguidance tokenizer of a Kog tokenizer, built on first use and cached with it.

    Args:
        tokenizer: Kog's tokenizer (its HF `tokenizers` object is serialized for llguidance).
        eos_token_ids: the ids that end a generation (the model's stop tokens); a grammar allows
            them exactly where it accepts. Empty: the tokenizer's EOS.

    Returns:
        An LLTokenizer whose token ids are the model's.
    """
    eos = tuple(eos_token_ids) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    if not eos:
        raise InvalidRequest("structured output needs an end-of-sequence token; the tokenizer has none")
    with _LOCK:
        per_tok = _LL_TOKENIZERS.setdefault(tokenizer, {})
        if eos not in per_tok:
            per_tok[eos] = llg.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size, eos_token=list(eos))
        return per_tok[eos]


def build_constraint(tokenizer: Tokenizer, params: StructuredOutputParams, eos_token_ids: tuple[int, ...] = (),
                     vocab_size: int | None = None, tool_format: ToolCallFormat = HERMES) -> Constraint:
    """Compiles a request's structured-output params into a fresh Constraint.

    Args:
        tokenizer: the model's tokenizer.
        params: what the output must look like.
        eos_token_ids: the model's stop token ids (see `ll_tokenizer`).
        vocab_size: width of the model's logits rows (>= the tokenizer's; padding ids are never allowed).
        tool_format: the model's tool-call syntax.

    Returns:
        A Constraint at the start of the output (a fork of a cached compiled one when the same
        grammar was compiled before).

    Raises:
        InvalidRequest: invalid or unsatisfiable schema, unsupported keyword, bad grammar or
            regex, a grammar whose start rule can never finish, or one that allows no first
            token: before any token is generated.
    """
    ll = ll_tokenizer(tokenizer, eos_token_ids)
    specials = frozenset(t.content for t in tokenizer.hf.get_added_tokens_decoder().values() if t.special)
    lark = lark_grammar(params, specials, tool_format)
    key = (id(ll), vocab_size or tokenizer.vocab_size, lark)
    with _LOCK:
        if key in _COMPILED:
            _COMPILED.move_to_end(key)
            return _COMPILED[key].fork()
    constraint = _compile(ll, params, lark, key[1])
    if params.kind == "tools":  # steered to close its calls within the budget (call_budget.py)
        start = constraint.matcher if params.tool_choice != "auto" else None
        names = [t["function"]["name"] for t in params.tools]
        constraint.budget = CallBudget(tokenizer, ll, key[1], tool_format.begin.strip("\n"),
                                       tool_format.end.strip("\n"), start, names)
    with _LOCK:
        _COMPILED[key] = constraint
        while len(_COMPILED) > COMPILED_CACHE_SIZE:
            _COMPILED.popitem(last=False)
    return constraint.fork()


def _compile(ll: llg.LLTokenizer, params: StructuredOutputParams, lark: str, vocab_size: int) -> Constraint:
    """build_constraint without the cache."""
    what = _what(params)
    if params.kind == "tools":
        _check_tool_schemas(params, ll)
    try:
        grammar = llg.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise InvalidRequest(f"structured output ({what}): {e}") from None
    matcher = llg.LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequest(f"structured output ({what}): {_without_excerpt(matcher.get_error())}")
    if params.kind == "grammar":
        stuck = unproductive_rules(params.grammar) or []
        if stuck[:1] == ["start"]:
            raise InvalidRequest(f"structured output ({what}): the grammar can never finish: rules "
                                 f"{', '.join(repr(r) for r in stuck)} only recurse, no alternative ends")
    constraint = Constraint(matcher, ll, vocab_size)
    if not constraint.allowed().any():
        raise InvalidRequest(f"structured output ({what}): the grammar allows no output at all")
    constraint.relaxed = tuple(matcher.get_grammar_warnings())
    if constraint.relaxed:  # once per compiled grammar (the cache holds it afterwards)
        log.warning("structured output (%s): not enforced: %s", what, "; ".join(constraint.relaxed))
    return constraint


def _what(params: StructuredOutputParams) -> str:
    """The constraint's kind and name, as error messages start: `json_schema 'person'`."""
    return params.kind + (f" {params.name!r}" if params.name else "")


class Constraint:
    """The grammar state of one sequence's output.

    Args:
        matcher: an llguidance matcher at the state to start from (not in error).
        tokenizer: the LLTokenizer it was built with.
        vocab_size: width of the logits rows it masks.

    NOTE: llguidance matchers enter a permanent error state on a disallowed token, so every
    mutating method checks first and raises InvalidOperation with the matcher unchanged.
    """

    def __init__(self, matcher: llg.LLMatcher, tokenizer: llg.LLTokenizer, vocab_size: int):
        if vocab_size < tokenizer.vocab_size:
            raise InvalidRequest(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size}")
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_tokens = 0  # tokens consumed so far: the most rollback() can undo
        # what the compiler relaxed (llguidance's warnings: `Unimplemented keys: ["not"]`, `Unknown format: x`)
        self.relaxed: tuple[str, ...] = ()
        self.budget: CallBudget | None = None  # tool calls: closes the open call before the budget ends
        self._allowed: torch.Tensor | None = None  # cache for the current state

    # ------------------------------------------------------------------ public API

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size] on the CPU: the tokens the grammar allows next (EOS where it accepts).
        Cached until the state changes: do not modify it."""
        if self._allowed is None:
            self._allowed = self._unpack(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8))
        return self._allowed

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] or [N, V] (any device) -> a copy with every disallowed token at -inf (all rows: this state)."""
        if logits.shape[-1] != self.vocab_size:
            raise InvalidRequest(f"logits have {logits.shape[-1]} columns, the constraint masks {self.vocab_size}")
        return logits.masked_fill(~self.allowed().to(logits.device), float("-inf"))

    def narrow(self, keep: torch.Tensor) -> None:
        """Allows, in this state only, just the allowed tokens that are also in `keep` (bool
        [vocab_size]); nothing changes where that would leave none."""
        narrowed = self.allowed() & keep
        if narrowed.any():
            self._allowed = narrowed

    def num_allowed(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the grammar accepts from here (state unchanged)."""
        tokens = [int(t) for t in tokens]
        n = self.matcher.validate_tokens(tokens) if tokens else 0
        if n < len(tokens) and tokens[n] in self.tokenizer.eos_tokens:
            # NOTE: llguidance's validate_tokens refuses EOS once the matcher is stopped (only EOS
            # can follow), although the mask allows it: EOS is allowed wherever the grammar accepts.
            for t in tokens[:n]:
                self.matcher.consume_token(t)
            eos_ok = self.matcher.is_accepting() and not self.matcher.is_error()
            self.matcher.rollback(n)
            n += eos_ok
        return n

    def advance(self, token: int) -> None:
        """Consumes one sampled token; InvalidOperation (state unchanged) if the grammar forbids it."""
        self.advance_many([token])

    def advance_many(self, tokens: list[int]) -> None:
        """Consumes tokens in order (accepted draft tokens, forced tokens); all or none."""
        tokens = [int(t) for t in tokens]
        n = self.num_allowed(tokens)
        if n < len(tokens):
            raise InvalidOperation(f"token {tokens[n]} ({self.tokenizer.dbg_tokens(tokens[n:n + 1])}) is not "
                                   f"allowed by the grammar after {self.num_tokens + n} tokens")
        if tokens:
            # NOTE: one by one: consume_tokens refuses EOS on a stopped matcher, consume_token takes it.
            for t in tokens:
                if not self.matcher.consume_token(t):
                    raise InvalidOperation(f"grammar error: {self.matcher.get_error()}")
            self.num_tokens += len(tokens)
            self._allowed = None

    def forced_tokens(self) -> list[int]:
        """Jump-forward: the tokens the grammar forces next, whatever the model would say (may be
        empty). They are not consumed: append them to the sequence, then `advance_many` them."""
        return [] if self.is_stopped() else list(self.matcher.compute_ff_tokens())

    def rollback(self, n: int) -> None:
        """Undoes the last n consumed tokens (rejected draft tokens, a client's edit)."""
        if not 0 <= n <= self.num_tokens:
            raise InvalidOperation(f"cannot roll back {n} tokens: {self.num_tokens} consumed")
        if n:
            if not self.matcher.rollback(n):
                raise InvalidOperation(f"grammar rollback of {n} failed: {self.matcher.get_error()}")
            self.num_tokens -= n
            self._allowed = None

    def fork(self) -> Constraint:
        """An independent copy at the same state (n > 1 completions, a forked session)."""
        twin = Constraint(self.matcher.deep_copy(), self.tokenizer, self.vocab_size)
        twin.num_tokens = self.num_tokens
        twin.relaxed, twin.budget = self.relaxed, self.budget
        twin._allowed = self._allowed  # same state, same mask (never modified in place)
        return twin

    def draft_masks(self, draft: list[int]) -> torch.Tensor:
        """bool [len(draft) + 1, vocab_size]: the allowed tokens before each draft token and after
        the last, i.e. the masks of the k + 1 verification rows. The state is unchanged on return.

        Raises:
            InvalidOperation: a draft token the grammar forbids (truncate with `num_allowed` first).
        """
        masks = [self.allowed()]
        for i, t in enumerate(draft):
            try:
                self.advance(t)
            except InvalidOperation:
                self.rollback(i)
                raise
            masks.append(self.allowed())
        self.rollback(len(draft))
        return torch.stack(masks)

    def _unpack(self, bits: np.ndarray) -> torch.Tensor:
        """llguidance's bitmask (uint8, little-endian bit order) -> bool [vocab_size]."""
        allowed = np.zeros(self.vocab_size, dtype=bool)
        n = self.tokenizer.vocab_size
        allowed[:n] = np.unpackbits(bits, bitorder="little")[:n]
        return torch.from_numpy(allowed)

    def is_accepting(self) -> bool:
        """The output so far is complete: EOS is allowed now."""
        return self.matcher.is_accepting()

    def is_stopped(self) -> bool:
        """Nothing but EOS can follow: the engine should end the sequence."""
        return self.matcher.is_stopped()


def batch_allowed(constraints: Sequence[Constraint]) -> torch.Tensor:
    """The allowed-token masks of many sequences, computed in parallel on llguidance's threads
    (one engine step's constrained rows); each constraint's mask cache is filled too.

    Args:
        constraints: constraints with the same vocab_size and tokenizer vocabulary.

    Returns:
        bool [len(constraints), vocab_size].
    """
    global _EXECUTOR
    if not constraints:
        return torch.empty(0, 0, dtype=torch.bool)
    sizes = {(c.vocab_size, c.tokenizer.vocab_size) for c in constraints}
    if len(sizes) != 1:
        raise InvalidRequest(f"batch_allowed: constraints disagree on the vocabulary: {sorted(sizes)}")
    todo = [(c.matcher, i) for i, c in enumerate(constraints) if c._allowed is None]
    if todo:
        words = (constraints[0].tokenizer.vocab_size + 31) // 32
        bits = np.zeros((len(constraints), words), dtype=np.int32)  # [B, words]
        with _LOCK:
            _EXECUTOR = _EXECUTOR or llg.LLExecutor()
        _EXECUTOR.unsafe_compute_mask_ptr(todo, bits.ctypes.data, words * 4, len(constraints))
        for _, i in todo:
            constraints[i]._allowed = constraints[i]._unpack(bits[i].view(np.uint8))
    return torch.stack([c.allowed() for c in constraints])


def _check_tool_schemas(params: StructuredOutputParams, ll: llg.LLTokenizer) -> None:
    """InvalidRequest naming the first tool whose parameters schema does not compile."""
    for tool in params.tools:
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(parameters_schema(tool), defaults=LENIENT)
            error = llg.LLMatcher.validate_grammar(grammar, ll)
        except ValueError as e:  # e.g. an integer outside int64, which llguidance cannot serialize
            error = str(e)
        if error:
            raise InvalidRequest(f"structured output (tools): function {tool['function']['name']!r} parameters: "
                                 f"{_without_excerpt(error)}")


def _without_excerpt(error: str) -> str:
    """llguidance's message without the grammar excerpt it appends (`   1 | start: ...`)."""
    return re.split(r"\n\s*\d+ \|", error, maxsplit=1)[0].strip()
