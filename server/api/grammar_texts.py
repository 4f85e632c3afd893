"""The grammar texts of the structured outputs' pieces, shared by structured_output.py (a request's whole
grammar) and format_grammar.py (the pieces of a structural tag's format): a JSON schema compiled compact and
a context-free grammar (Lark, or llama.cpp's GBNF) as Lark, bounded before it is converted."""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

ANY_OBJECT = {"type": "object"}
JSON_DEFAULTS = {"whitespace_flexible": False}  # llguidance JsonCompileOptions, under the schema's own
# a context-free grammar's text: llguidance converts GBNF to Lark in Python, in time quadratic in its rules,
# holding the GIL (1,000 rules, 24 KB: 1.2 s; a review), so the text is bounded before it is converted
MAX_CFG_CHARS = 8 << 10


def json_grammar(schema: dict[str, Any] | str | None) -> str:
    """A JSON schema (a dict or its JSON text; None: any JSON object) -> its compact JSON grammar."""
    return LLMatcher.grammar_from_json_schema(ANY_OBJECT if schema is None else schema,
                                              defaults=JSON_DEFAULTS)


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with JSON_DEFAULTS under its own "x-guidance" options, as json_grammar compiles it (a
    schema inlined in a Lark grammar with %json gets no defaults passed)."""
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
