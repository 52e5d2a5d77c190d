"""Text that can be tokenized: Python strings without lone surrogates.

JSON lets a client write `"\\ud800"`, and Python decodes it into a one-character str that has
no UTF-8 form; the tokenizer (and any UTF-8 response that echoes it) cannot take it. Kog refuses
such text where it enters, naming the field, rather than replacing it: a request whose text was
silently altered would be a different request.
"""

from __future__ import annotations

import re
from typing import Any

from kog.errors import InvalidRequest

_SURROGATE = re.compile("[\ud800-\udfff]")

Path = tuple[str | int, ...]


def lone_surrogate_at(value: Any, path: Path = ()) -> tuple[Path, int, str] | None:
    """The first string inside `value` (a str, or lists / tuples / dicts of them, keys included)
    that holds a lone surrogate.

    Returns:
        (path to the string, index of the surrogate in it, the surrogate as U+XXXX), or None.
    """
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        return (path, m.start(), f"U+{ord(m.group()):04X}") if m else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = lone_surrogate_at(k, path) or lone_surrogate_at(v, (*path, str(k)))
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = lone_surrogate_at(v, (*path, i))
            if found:
                return found
    return None


def invalid_text_message(field: str, index: int, codepoint: str) -> str:
    """The error message for a lone surrogate (never quotes the text: it cannot be encoded)."""
    return (f"{field} is not valid Unicode text: it holds a lone surrogate ({codepoint} at character {index}); "
            "send text as UTF-8, or replace unpaired surrogates with U+FFFD")


def check_text(value: Any, field: str) -> None:
    """Raises InvalidRequest naming `field[...]` when `value` holds a lone surrogate anywhere.

    Args:
        value: a string, or lists / dicts of strings (a message, a list of prompts).
        field: the argument's name, e.g. "messages" or "prompts".
    """
    found = lone_surrogate_at(value)
    if found is not None:
        path, index, codepoint = found
        raise InvalidRequest(invalid_text_message(field + python_path(path), index, codepoint))


def python_path(path: Path) -> str:
    """("0", "content") style paths as Python subscripts: `[0]['content']`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f"[{p!r}]" for p in path)
