"""Can a Lark grammar ever finish? llguidance compiles `start: "a" x` / `x: "b" x` happily, and
a request would then run to max_tokens without ever producing a complete output. A rule is
productive when one of its alternatives derives a finite string; the grammar can finish iff
`start` is productive (the textbook fixed point over the rules).

The check covers Lark's expression syntax (alternatives, groups, `[...]`, `? * +`, `~ n..m`,
strings, regexes, special tokens, `%json {...}`, `@subgrammar`, aliases). Anything it does not
parse (templates, `%import`, terminal operators) makes it answer "unknown" and leave the
grammar to llguidance, so it can never reject a grammar that works.
"""

from __future__ import annotations

import re

_DEF = re.compile(r"^[?!]?([A-Za-z_]\w*)(\[[^\]]*\])?(\.-?\d+)?\s*:(?!:)(.*)$")
_TOKEN = re.compile(r"""
    (?P<ws>\s+|//[^\n]*)
  | (?P<str>"(?:[^"\\]|\\.)*"i?(?:\s*\.\.\s*"(?:[^"\\]|\\.)*")?)
  | (?P<re>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<special><\|[^|]*\|>|<\[[\d\-,\s]+\]>|<[^\s<>"]+>)
  | (?P<json>%json\b)
  | (?P<sub>@\w+)
  | (?P<name>\w+)
  | (?P<rep>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<arrow>->\s*\w+)
  | (?P<op>[|()\[\]?*+])
""", re.X)


class _Unknown(Exception):
    """Syntax this check does not model."""


def unproductive_rules(lark: str) -> list[str] | None:
    """The rules that can never derive a finite string, `start` first if it is one of them.

    Args:
        lark: grammar text (llguidance's Lark dialect).

    Returns:
        Sorted names (with "start" first when unproductive); [] when every rule can finish;
        None when the grammar uses syntax this check does not model.
    """
    try:
        rules = {name: _parse(body) for name, body in _definitions(lark).items()}
        productive: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, expr in rules.items():
                if name not in productive and _productive(expr, productive, rules):
                    productive.add(name)
                    changed = True
    except _Unknown:
        return None
    bad = sorted(set(rules) - productive)
    return sorted(bad, key=lambda n: n != "start")


# ---------------------------------------------------------------------- internal helpers


def _definitions(lark: str) -> dict[str, str]:
    """Rule and terminal name -> the text of its right-hand side (continuation lines joined)."""
    defs: dict[str, str] = {}
    current = None
    for line in lark.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if stripped.startswith("%"):
            if not re.match(r"%(llguidance|ignore)\b", stripped):
                raise _Unknown(stripped)
            current = None
            continue
        m = _DEF.match(stripped)
        if m:
            current = m.group(1)
            defs[current] = defs.get(current, "") + (" | " if current in defs else "") + m.group(4)
        elif current is not None:
            defs[current] += " " + stripped
        else:
            raise _Unknown(stripped)
    return defs


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body):
        if body.startswith("%json", pos):  # the schema itself: skip its balanced JSON object
            out.append(("lit", "%json"))
            pos = _skip_json(body, pos + len("%json"))
            continue
        m = _TOKEN.match(body, pos)
        if m is None:
            raise _Unknown(body[pos:pos + 20])
        kind = m.lastgroup
        if kind != "ws":
            out.append(("lit", m.group()) if kind in ("str", "re", "special", "sub") else (kind, m.group()))
        pos = m.end()
    return out


def _skip_json(body: str, pos: int) -> int:
    depth, in_str, i = 0, False, pos
    while i < len(body):
        ch = body[i]
        if in_str:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif not ch.isspace() and depth == 0:
            raise _Unknown("%json without an object")
        i += 1
    raise _Unknown("unbalanced %json")


def _parse(body: str):
    """Expression tree: ("alt", [seqs]), ("seq", [items]), ("opt",), ("ref", name), ("lit",)."""
    toks = _tokens(body)
    expr, end = _alt(toks, 0)
    if end != len(toks):
        raise _Unknown(str(toks[end]))
    return expr


def _alt(toks, i):
    seqs = []
    while True:
        seq, i = _seq(toks, i)
        seqs.append(seq)
        if i < len(toks) and toks[i] == ("op", "|"):
            i += 1
            continue
        return ("alt", seqs), i


def _seq(toks, i):
    items = []
    while i < len(toks) and toks[i] not in (("op", "|"), ("op", ")"), ("op", "]")):
        kind, text = toks[i]
        if kind == "arrow":
            i += 1
            continue
        if text in ("(", "["):
            inner, i = _alt(toks, i + 1)
            if i >= len(toks) or toks[i][1] != (")" if text == "(" else "]"):
                raise _Unknown("unbalanced group")
            atom = inner if text == "(" else ("opt",)
        elif kind == "lit":
            atom = ("lit",)
        elif kind == "name":
            atom = ("ref", text)
        else:
            raise _Unknown(text)
        i += 1
        if i < len(toks) and (toks[i][1] in ("?", "*") or (toks[i][0] == "rep" and re.match(r"~\s*0\b", toks[i][1]))):
            atom, i = ("opt",), i + 1
        elif i < len(toks) and (toks[i][1] == "+" or toks[i][0] == "rep"):
            i += 1
        items.append(atom)
    return ("seq", items), i


def _productive(expr, productive: set[str], rules: dict) -> bool:
    kind = expr[0]
    if kind == "alt":
        return any(_productive(e, productive, rules) for e in expr[1])
    if kind == "seq":
        return all(_productive(e, productive, rules) for e in expr[1])
    if kind == "ref":
        if expr[1] not in rules:
            raise _Unknown(expr[1])  # llguidance reports unknown names itself
        return expr[1] in productive
    return True
