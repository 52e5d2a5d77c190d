"""`uniqueItems` over enum / const items, rewritten into tuples llguidance enforces: the rewritten
schema accepts exactly the arrays the original accepts (jsonschema, which implements uniqueItems,
is the reference) when the orderings are few, only duplicate-free arrays in enum order when the
selections are few, and is left alone (relaxed) beyond; nothing but array schemas is touched."""

import itertools

import pytest

from kog.structured_output.unique_items import MAX_TUPLES, enforce_unique_items

jsonschema = pytest.importorskip("jsonschema")


def arrays(values, longest):
    """Every array of up to `longest` items drawn from values, repeats included."""
    return [list(a) for k in range(longest + 1) for a in itertools.product(values, repeat=k)]


def accepted(schema, candidates):
    v = jsonschema.Draft202012Validator(schema)
    return [a for a in candidates if v.is_valid(a)]


@pytest.mark.parametrize("bounds", [{}, {"minItems": 1}, {"minItems": 2, "maxItems": 3}, {"maxItems": 1}])
@pytest.mark.parametrize("items", [{"enum": ["a", "b", "c"]}, {"type": "integer", "enum": [1, 2, 1.0]},
                                   {"const": "x"}])
def test_few_orderings_are_enforced_exactly(items, bounds):
    schema = {"type": "array", "items": items, "uniqueItems": True, **bounds}
    rewritten = enforce_unique_items(schema)
    assert rewritten is False or ("uniqueItems" not in rewritten and len(rewritten["anyOf"]) <= MAX_TUPLES)
    values = items.get("enum", [items.get("const")]) + ["z"]
    candidates = arrays(values, 4)
    assert accepted(rewritten, candidates) == accepted(schema, candidates)


def test_many_orderings_fall_back_to_the_enum_order():
    values = [f"v{i}" for i in range(7)]  # 13700 orderings, 128 selections
    schema = {"type": "array", "items": {"enum": values}, "uniqueItems": True}
    rewritten = enforce_unique_items(schema)
    assert len(rewritten["anyOf"]) == 2 ** 7
    candidates = arrays(values[:4], 3)
    assert accepted(rewritten, candidates) == [a for a in candidates if a == sorted(set(a), key=values.index)]


def test_too_many_selections_are_left_to_the_lenient_compiler():
    schema = {"type": "array", "items": {"enum": list(range(12))}, "uniqueItems": True}
    assert enforce_unique_items(schema) == schema
    assert enforce_unique_items({"type": "array", "items": {"type": "string"}, "uniqueItems": True})["uniqueItems"]


def test_only_schemas_are_rewritten():
    color = {"enum": ["red", "green", "blue"]}
    schema = {"type": "object", "$defs": {"Color": color},
              "properties": {"uniqueItems": {"type": "boolean"},       # a property named like the keyword
                             "colors": {"type": "array", "items": {"$ref": "#/$defs/Color"}, "uniqueItems": True,
                                        "description": "kept"},
                             "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": False},
                             "either": {"anyOf": [{"type": "array", "items": {"const": 1}, "uniqueItems": True},
                                                  {"type": "null"}]}},
              "default": {"uniqueItems": True, "items": {"enum": [1, 2]}}}  # data, not a schema
    out = enforce_unique_items(schema)
    assert out["properties"]["uniqueItems"] == {"type": "boolean"} and out["default"] == schema["default"]
    assert out["properties"]["tags"] == {"type": "array", "items": {"type": "string"}}
    colors = out["properties"]["colors"]
    assert colors["description"] == "kept" and len(colors["anyOf"]) == 1 + 3 + 6 + 6
    assert accepted(out, [{"colors": ["red", "blue"]}, {"colors": ["red", "red"]}, {"either": [1, 1]},
                          {"either": [1]}]) == [{"colors": ["red", "blue"]}, {"either": [1]}]
    assert schema["properties"]["colors"]["uniqueItems"] is True  # the argument is not modified


def test_more_distinct_items_than_values_is_unsatisfiable():
    assert enforce_unique_items({"type": "array", "items": {"enum": ["a", "b", "a"]}, "uniqueItems": True,
                                 "minItems": 3}) is False
