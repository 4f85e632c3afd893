"""The grammar texts of the structured outputs' pieces, shared by structured_output.py (a request's whole
grammar) and format_grammar.py (the pieces of a structural tag's format): a JSON schema compiled compact and
a context-free grammar (Lark, or llama.cpp's GBNF) as Lark, bounded before it is converted."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

ANY_OBJECT = {"type": "object"}
JSON_DEFAULTS = {"whitespace_flexible": False}  # llguidance JsonCompileOptions, under the schema's own
# a context-free grammar's text: llguidance converts GBNF to Lark in Python, in time quadratic in its rules,
# holding the GIL (1,000 rules, 24 KB: 1.2 s; a review), so the text is bounded before it is converted
MAX_CFG_CHARS = 8 << 10


# the largest integer a JSON number keeps exactly as an IEEE double: llguidance reads bounds as doubles (past
# 2**63 clamped to i64), so a bound beyond it admitted numbers outside the range (a review)
EXACT_BOUND = 2**53
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values that are data, not schemas


def json_grammar(schema: dict[str, Any] | str | None) -> str:
    """A JSON schema (a dict or its JSON text; None: any JSON object) -> its compact JSON grammar; a
    ValueError for number bounds that llguidance does not enforce (check_number_bounds)."""
    if isinstance(schema, str):  # parsed once, here: text that is not JSON goes on, for llguidance to say why
        with contextlib.suppress(json.JSONDecodeError, RecursionError):
            schema = json.loads(schema)
    if not isinstance(schema, str):
        check_number_bounds(schema)
    return LLMatcher.grammar_from_json_schema(ANY_OBJECT if schema is None else schema,
                                              defaults=JSON_DEFAULTS)


def check_number_bounds(schema: Any) -> None:
    """A ValueError for the number bounds that llguidance 1.9.1 compiles wrongly (its replies then break the
    schema with finish_reason "stop"; a review): a bound past 2**53, and an exclusive bound at an integer N
    whose range lies between N and the next integer away from 0, its other end's integer part N
    ({"exclusiveMinimum": 0, "maximum": 0.5} took "0", {"exclusiveMinimum": -2, "maximum": -1.7} is
    right). Walks every subschema without recursion (a schema may nest a thousand levels)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        _check_node_bounds(node)
        stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS and isinstance(v, dict | list))


def _check_node_bounds(node: dict) -> None:
    bounds = {k: v for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
              if _is_number(v := node.get(k))}
    for key, value in bounds.items():
        if abs(value) > EXACT_BOUND:
            raise ValueError(f"'{key}': {json.dumps(value)} is beyond +-2**53, where bounds are not "
                             f"enforced exactly")
    types = node.get("type")
    if types is not None and "number" not in (types if isinstance(types, list) else [types]):
        return  # an integer's exclusive bounds compile right
    low, low_open = _bound(node, bounds, "minimum", "exclusiveMinimum")
    high, high_open = _bound(node, bounds, "maximum", "exclusiveMaximum")
    if low is None or high is None:
        return
    for value, is_open, other in ((low, low_open, high), (high, high_open, low)):
        if is_open and value == int(value) and int(other) == value:
            raise ValueError(f"an exclusive bound at the integer {json.dumps(value)} with the whole range "
                             f"between it and the next integer from 0 is not enforced (the integer itself "
                             f"would be generated); give the bound as a non-integer or widen the range")


def _bound(node: dict, bounds: dict, inclusive: str, exclusive: str) -> tuple[float | None, bool]:
    """(the tighter of the two bounds on one side, whether it is open); draft 4's boolean exclusive* makes
    the inclusive keyword's value open."""
    if node.get(exclusive) is True and inclusive in bounds:
        return bounds[inclusive], True
    incl, excl = bounds.get(inclusive), bounds.get(exclusive)
    if excl is None:
        return incl, False
    if incl is None:
        return excl, True
    tighter_excl = excl >= incl if inclusive == "minimum" else excl <= incl
    return (excl, True) if tighter_excl else (incl, False)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with JSON_DEFAULTS under its own "x-guidance" options, as json_grammar compiles it (a
    schema inlined in a Lark grammar with %json gets no defaults passed)."""
    check_number_bounds(schema)
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):
        raise ValueError(f"a schema's 'x-guidance' must be an object, got {json.dumps(own)}")
    return {**schema, "x-guidance": {**JSON_DEFAULTS, **own}}


def cfg_lark(text: str) -> str:
    """A context-free grammar (Lark, or GBNF) -> its Lark text; a ValueError past MAX_CFG_CHARS or for GBNF
    that does not convert."""
    if len(text) > MAX_CFG_CHARS:
        raise ValueError(f"the grammar has {len(text)} characters, more than {MAX_CFG_CHARS}")
    try:
        return any_to_lark(text)
    except Exception as e:  # the converter raises what its parser meets
        raise ValueError(f"Failed to convert the grammar from GBNF to Lark: {e}") from None
