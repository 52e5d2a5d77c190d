"""Editing lowered programs (lists of kog._C.Op) in tests: one op rebuilt with some fields replaced."""

from __future__ import annotations

from typing import Sequence

from kog import _C

# The Op constructor's arguments that read back as attributes of the same name (expert_ranks does not).
_FIELDS = ("opcode", "layer", "in_", "residual", "out", "w0", "w1", "deps", "w2", "w_type", "w1_type", "lanes",
           "slot", "window", "vocab_slice", "w_scale")


def with_op(ops: Sequence[_C.Op], i: int, **fields) -> list[_C.Op]:
    """ops with op i rebuilt from its own fields, `fields` replacing some of them. An op with
    expert_ranks must be given them again (they cannot be read back)."""
    args = {f: getattr(ops[i], f) for f in _FIELDS} | fields
    return list(ops[:i]) + [_C.Op(**args)] + list(ops[i + 1:])
