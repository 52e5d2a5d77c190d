"""Finishing a constrained tool call within the token budget (max_tokens, or the context).

A small model sampled at temperature 1 can write one JSON string for hundreds of tokens; cut by
max_tokens, the call is lost and the reply has no tool call at all. In the last WINDOW tokens of
the budget, every token sampled inside a call is checked (~1 ms):

    fits(token)                   the call can still be finished after it within the budget, by
                                  the route below (forced tokens count), with room for EOS after
                                  it when the reply must be calls
    a token that does not fit     is drawn again from the allowed tokens that only close (their
                                  bytes are `"`, `}`, `]` or blanks, the first closing the
                                  innermost open string, object or array), or is the route's next
                                  token when none is allowed
    between calls                 tool_choice "required" / named: once a whole new call would not
                                  fit (remaining <= the longest of the tools' routes + 1), only EOS

The model's own token is kept whenever the route can still end the call in time, so a model
that closes its calls itself is left alone, and one that rambles is cut short at the last
moment. The route closes the innermost string / object / array whenever the grammar allows it
(with the token that closes the most), else takes the first allowed one-byte token of ROUTE_TEXT
(separators, then digits, then letters: numbers end at once and patterns such as dates fill in a
few tokens), and takes forced tokens as they come. NOTE: it is not the shortest completion: it
may write an optional key (`"description": ""`) or a longer enum value, so a call that would
just fit can be closed some tokens early, and a budget between the shortest call and the route
can still cut one. Nothing changes outside a call (free text of "auto"), nor for a call whose
route exceeds WINDOW.
"""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from kog.loader.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance as llg

WINDOW = 256  # budget left under which tokens are checked at all (a call needing more is cut)
ROUTE_TEXT = ",@.:-/_1234567890abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ [{\""
CLOSERS = b'"}]'
_SIGNIFICANT = re.compile(rb'["\\{}\[\]]')  # the bytes JsonScan acts on
_NAME = b'"name": "'  # where a call's tool name starts (kog.structured_output.formats: compact separators)


class TokenTables:
    """What the route needs of a vocabulary, built once per tokenizer (~40 ms for 49k tokens).

    Args:
        ll: the llguidance tokenizer.
    """

    def __init__(self, ll: llg.LLTokenizer) -> None:
        # The tokens whose bytes are all closing bytes or blanks, by their first non-blank byte,
        # the ones with the most closing bytes first (`"}}` before `"`).
        self.closers: dict[int, list[int]] = {b: [] for b in CLOSERS}
        for t in range(ll.vocab_size):
            text = ll.decode_bytes([t])
            if text.strip() and not text.translate(None, CLOSERS).strip() and not ll.is_special_token(t):
                self.closers[text.lstrip()[0]].append(t)
        for ids in self.closers.values():
            ids.sort(key=lambda t: (-len(ll.decode_bytes([t]).strip()), len(ll.decode_bytes([t]))))
        single = {ch: ll.tokenize_str(ch) for ch in ROUTE_TEXT}
        self.route = [ids[0] for ch, ids in single.items() if len(ids) == 1]


_TABLES: weakref.WeakKeyDictionary[Tokenizer, TokenTables] = weakref.WeakKeyDictionary()


class JsonScan:
    """Where a JSON text stands: the open objects / arrays, inside a string, after a backslash."""

    def __init__(self) -> None:
        self.stack: list[int] = []  # b"{" or b"[" of each open container, innermost last
        self.in_string = False
        self.escaped = False

    def feed(self, data: bytes, start: int = 0) -> int | None:
        """Scans data[start:]; returns the index just past the byte that closed the outermost
        object / array (the rest is not scanned), or None."""
        skip = start if self.escaped else -1  # the byte after a backslash is text, whatever it is
        self.escaped = self.escaped and start >= len(data)
        for m in _SIGNIFICANT.finditer(data, start):
            i, b = m.start(), data[m.start()]
            if i == skip:
                continue
            if self.in_string:
                if b == 0x5C:  # backslash
                    skip = i + 1
                    self.escaped = skip == len(data)
                elif b == 0x22:
                    self.in_string = False
            elif b == 0x22:
                self.in_string = True
            elif b in b"{[":
                self.stack.append(b)
            elif b in b"}]" and self.stack:
                self.stack.pop()
                if not self.stack:
                    return i + 1
        return None

    def closer(self) -> int | None:
        """The byte that closes the innermost open string / object / array (None: nothing open, or
        right after a backslash)."""
        if self.in_string:
            return None if self.escaped else 0x22
        if self.stack:
            return 0x7D if self.stack[-1] == 0x7B else 0x5D
        return None

    def copy(self) -> JsonScan:
        twin = JsonScan()
        twin.stack, twin.in_string, twin.escaped = list(self.stack), self.in_string, self.escaped
        return twin


class CallBudget:
    """Keeps one compiled tool-call grammar's sequences able to close their call in time (shared
    by every fork of the grammar: it keeps no per-sequence state).

    Args:
        tokenizer: the model's tokenizer.
        ll: its llguidance tokenizer.
        vocab_size: width of the masks.
        begin, end: the call markers' text (`<tool_call>`, `</tool_call>`).
        start: a matcher at the start of the output, when the reply must be calls (tool_choice
            "required" / named): the route of one whole call is measured from it. None ("auto").
        names: the tools a call may name.
    """

    def __init__(self, tokenizer: Tokenizer, ll: llg.LLTokenizer, vocab_size: int, begin: str, end: str,
                 start: llg.LLMatcher | None, names: list[str]) -> None:
        self.ll, self.vocab_size = ll, vocab_size
        self.begin, self.end = begin.encode(), end.encode()
        if tokenizer not in _TABLES:
            _TABLES[tokenizer] = TokenTables(ll)
        self._tables = _TABLES[tokenizer]
        self._closing = {b: self._mask(np.asarray(ids, dtype=np.int64)) for b, ids in self._tables.closers.items()}
        self._eos = self._mask(np.asarray(ll.eos_tokens))
        # the most tokens a whole call takes by the route, over the tools (from the start state)
        self.call_need = self._whole_call_need(start, names) if start is not None else None

    @staticmethod
    def near(remaining: int) -> bool:
        """Whether a sequence with `remaining` tokens left is checked (then it does not speculate:
        verification would keep draft tokens without the check)."""
        return remaining <= WINDOW

    def before_sampling(self, matcher: llg.LLMatcher, allowed: torch.Tensor, output_ids: list[int],
                        remaining: int) -> torch.Tensor | None:
        """Between calls, when a whole new call would not fit: only EOS (bool [vocab_size], part
        of `allowed`). None: the grammar's mask as it is.

        Args:
            matcher: the sequence's grammar state (not modified); it has consumed output_ids.
            allowed: the grammar's mask in that state.
            output_ids: the sequence's output so far.
            remaining: tokens the sequence may still generate.
        """
        if (self.call_need is None or remaining > self.call_need + 1 or not matcher.is_accepting()
                or self.open_call(self.ll.decode_bytes(list(output_ids))) is not None):
            return None
        keep = self._eos & allowed
        return keep if keep.any() else None

    def fits(self, matcher: llg.LLMatcher, output_ids: list[int], token: int, remaining: int) -> bool:
        """Whether the call `token` continues (or opens) can still be finished by the route in
        the `remaining - 1` tokens left after it (and EOS after it, when the reply must be calls).
        True outside a call and before the window."""
        if not self.near(remaining) or token in self.ll.eos_tokens:
            return True
        scan = self.open_call(self.ll.decode_bytes([*output_ids, token]))
        m = matcher.deep_copy()
        if scan is None or not m.consume_token(token):
            return True
        left = remaining - 1 - (self.call_need is not None)
        route = self.route(m, scan, left)
        return route is not None and route[0] <= left

    def closing(self, matcher: llg.LLMatcher, allowed: torch.Tensor, output_ids: list[int],
                closers: bool = True) -> torch.Tensor | None:
        """The tokens to draw from instead of one that does not fit (bool [vocab_size]): the
        allowed tokens that only close (when `closers`), else the route's next token; None when
        there is no route (the token is left alone)."""
        scan = self.open_call(self.ll.decode_bytes(list(output_ids)))
        if scan is None:
            return None
        closing = self._closing.get(scan.closer()) if closers else None
        keep = closing & allowed if closing is not None else None
        if keep is not None and keep.any():
            return keep
        route = self.route(matcher.deep_copy(), scan, WINDOW)
        return None if route is None else self._mask(np.asarray([route[1]]))

    def open_call(self, text: bytes) -> JsonScan | None:
        """Where the call the output ends in stands, or None when it is not inside a call. Calls
        are found in order (a marker inside a call's JSON string is text, not a new call)."""
        pos = 0
        while (at := text.find(self.begin, pos)) >= 0:
            scan = JsonScan()
            closed = scan.feed(text, at + len(self.begin))
            end = -1 if closed is None else text.find(self.end, closed)
            if end < 0:
                return scan
            pos = end + len(self.end)
        return None

    def route(self, matcher: llg.LLMatcher, scan: JsonScan, limit: int) -> tuple[int, int] | None:
        """(tokens to the end of the open call, the first of them) along the route, or None when
        it takes more than `limit` tokens or gets stuck. Advances `matcher` and `scan`."""
        n, first = 0, -1
        while n <= limit:
            if matcher.is_accepting():
                return n, first
            if matcher.is_stopped() or matcher.is_error():
                return None
            take = list(matcher.compute_ff_tokens()) or self._route_token(matcher, scan)
            if not take or not matcher.consume_tokens(take):
                return None
            scan.feed(self.ll.decode_bytes(take))  # NOTE: past the call's JSON it stays closed
            first = take[0] if n == 0 else first
            n += len(take)
        return None

    # ------------------------------------------------------------------ internal helpers

    def _whole_call_need(self, start: llg.LLMatcher, names: list[str]) -> int | None:
        """The longest route of a whole call over the tools it may name (the route alone would
        pick one name); the route from `start` when the names cannot be told apart."""
        m, prefix = start.deep_copy(), []
        while forced := list(m.compute_ff_tokens()):  # up to where the tools differ
            if not m.consume_tokens(forced):
                return None
            prefix += forced
        text = self.ll.decode_bytes(prefix)
        typed = text[text.rfind(_NAME) + len(_NAME):].decode(errors="replace") if _NAME in text else None
        needs = []
        for name in names:
            if typed is None or not name.startswith(typed):
                continue
            twin, rest = m.deep_copy(), name[len(typed):].encode()
            ids = self.ll.tokenize_bytes(rest)
            if twin.validate_tokens(ids) == len(ids) and twin.consume_tokens(ids):
                route = self.route(twin, self.open_call(text + rest), WINDOW)
                needs.append(None if route is None else len(prefix) + len(ids) + route[0])
        if needs and None not in needs:
            return max(needs)
        route = self.route(start.deep_copy(), JsonScan(), WINDOW)
        return None if route is None else route[0]

    def _route_token(self, matcher: llg.LLMatcher, scan: JsonScan) -> list[int]:
        """The allowed token that closes the most (`"}}` before `"`) when one closes, else the
        first allowed route token, else the first token of the forced bytes (a marker's last
        bytes, not forced as a token because free text after it could merge with them); [] when
        none is allowed."""
        candidates = self._tables.closers.get(scan.closer(), []) + self._tables.route
        candidates += self.ll.tokenize_bytes(matcher.compute_ff_bytes())[:1]
        chosen = next(([t] for t in candidates if matcher.validate_tokens([t]) == 1), [])
        if not chosen:  # e.g. inside a UTF-8 character: any allowed token but EOS (a full mask, rare)
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            eos = set(self.ll.eos_tokens)
            chosen = next(([int(t)] for t in np.flatnonzero(bits[:self.ll.vocab_size]) if int(t) not in eos), [])
        return chosen

    def _mask(self, ids: np.ndarray) -> torch.Tensor:
        keep = torch.zeros(self.vocab_size, dtype=torch.bool)
        keep[torch.from_numpy(ids.astype(np.int64))] = True
        return keep

