"""`uniqueItems` over a finite set of values, rewritten into a schema llguidance enforces exactly.

llguidance does not implement `uniqueItems` (in lenient mode it ignores it). An array whose
items are an `enum` or a `const` (directly or through a local `$ref`) has finitely many
duplicate-free values, so its schema becomes an `anyOf` of fixed tuples (`prefixItems` of
`const`s, `items: false`, `minItems` = the tuple's length):

- every ordering of every allowed selection (permutations), when there are at most MAX_TUPLES:
  exactly the arrays the schema allows;
- else every selection in the enum's order (combinations), when there are at most MAX_TUPLES:
  no output has a duplicate, but the order of the values is the enum's;
- else the schema is left as it is and the keyword is relaxed (the compiler reports it).

`uniqueItems: false` constrains nothing and is dropped.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

# NOTE: llguidance compiles ~0.2 ms per tuple (cached per grammar afterwards); 512 tuples cover
# every ordering of up to 5 values, and every selection of up to 9 values.
MAX_TUPLES = 512

# Keywords whose value is one subschema, a list of subschemas, or a map of name -> subschema:
# the places a schema nests schemas (anything else, e.g. `enum` or `default`, holds data).
_ONE = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames", "not", "if", "then",
        "else", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("items", "prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# What the rewrite consumes of an array schema; the other keywords stay beside the anyOf.
_CONSUMED = ("uniqueItems", "items", "minItems", "maxItems")


def enforce_unique_items(schema: Any) -> Any:
    """A copy of `schema` with every `uniqueItems` rewritten as the module describes (the
    argument is not modified; a schema without `uniqueItems` comes back equal). An array that
    needs more distinct items (`minItems`) than its items allow becomes `false` (unsatisfiable:
    the compiler refuses it unless another branch of an anyOf remains)."""
    return _walk(schema, schema)


# ---------------------------------------------------------------------- internal helpers


def _walk(node: Any, root: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _MAP and isinstance(value, dict):
            out[key] = {name: _walk(sub, root) for name, sub in value.items()}
        elif key in _LIST and isinstance(value, list):
            out[key] = [_walk(sub, root) for sub in value]
        elif key in _ONE:
            out[key] = _walk(value, root)
        else:
            out[key] = value
    return _rewrite(out, root) if "uniqueItems" in out else out


def _rewrite(schema: dict[str, Any], root: Any) -> dict[str, Any] | bool:
    """One array schema with `uniqueItems`: the anyOf of tuples, or unchanged (relaxed)."""
    if schema["uniqueItems"] is False:
        return {k: v for k, v in schema.items() if k != "uniqueItems"}
    items = schema.get("items")
    values = _finite_values(items, root)
    lo, hi = schema.get("minItems", 0), schema.get("maxItems")
    if (schema["uniqueItems"] is not True or values is None or "prefixItems" in schema or "anyOf" in schema
            or not _count(lo) or (hi is not None and not _count(hi))):
        return schema
    n = len(values)
    hi = n if hi is None else min(hi, n)
    if lo > hi:  # more distinct items asked than there are values: nothing is valid
        return False
    if sum(math.perm(n, k) for k in range(lo, hi + 1)) <= MAX_TUPLES:
        choose = itertools.permutations
    elif sum(math.comb(n, k) for k in range(lo, hi + 1)) <= MAX_TUPLES:
        choose = itertools.combinations
    else:
        return schema
    item = {k: v for k, v in items.items() if k not in ("enum", "const", "$ref")}
    tuples = [{"prefixItems": [{**item, "const": v} for v in chosen], "items": False, "minItems": k}
              for k in range(lo, hi + 1) for chosen in choose(values, k)]
    return {**{k: v for k, v in schema.items() if k not in _CONSUMED}, "anyOf": tuples}


def _finite_values(items: Any, root: Any, depth: int = 0) -> list[Any] | None:
    """The distinct values an items schema allows when it is an enum / const (or a local $ref
    to one), else None."""
    if not isinstance(items, dict) or depth > 8:
        return None
    if "enum" in items and isinstance(items["enum"], list):
        values = items["enum"]
    elif "const" in items:
        values = [items["const"]]
    elif isinstance(items.get("$ref"), str) and len(items) == 1:
        return _finite_values(_resolve(items["$ref"], root), root, depth + 1)
    else:
        return None
    distinct: list[Any] = []
    for v in values:
        if not any(_json_equal(v, d) for d in distinct):
            distinct.append(v)
    return distinct


def _resolve(ref: str, root: Any) -> Any:
    """The subschema a local JSON pointer (`#/$defs/Color`) names, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema sees it: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
    return (numbers or type(a) is type(b)) and a == b


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
