"""JSON schemas llguidance 1.9.1 would compile wrongly, and schemas nested past Python's stack: a 400 naming
the field, never a reply that breaks its schema with finish_reason "stop", never a 500 (cases from a
review)."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import llguidance
import pytest

from server.api.app import create_app
from server.api.grammar_texts import JSON_DEFAULTS, check_number_bounds
from server.engine import grammar as core_grammar
from server.model.tokenizer import ByteTokenizer
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=64) as eng:
        yield create_app(eng)


def in_range(schema: dict, text: str) -> bool:
    v = float(text)
    lo, hi = schema.get("minimum"), schema.get("maximum")
    elo, ehi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    return ((lo is None or v >= lo) and (hi is None or v <= hi) and (elo is None or v > elo)
            and (ehi is None or v < ehi))


def grid() -> list[dict]:
    """Exclusive bounds at integers and off them, the other end 0.3 to 1.5 away, inclusive or open."""
    out = []
    for n, off, side, other in itertools.product((-2, 0, 1, 10, 0.5), (0.3, 0.7, 1.0, 1.5),
                                                 ("low", "high"), ("inclusive", "open")):
        if side == "low":
            out.append({"exclusiveMinimum": n,
                        "maximum" if other == "inclusive" else "exclusiveMaximum": round(n + off, 2)})
        else:
            out.append({"exclusiveMaximum": n,
                        "minimum" if other == "inclusive" else "exclusiveMinimum": round(n - off, 2)})
    return out


@pytest.fixture(scope="module")
def accepts():
    tok = ByteTokenizer()
    vocab = core_grammar.vocabulary(tok, tok.eos_token_ids)

    def accepts(schema: dict, text: str) -> bool:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)  # unchecked
        m = llguidance.LLMatcher(vocab, grammar, log_level=0, limits=core_grammar.LIMITS)
        return all(m.consume_token(b + ByteTokenizer.OFFSET) for b in text.encode()) and m.is_accepting()

    return accepts


def test_a_number_schema_that_compiles_takes_no_number_out_of_its_range(accepts):
    """Over the grid, every schema either is refused or its grammar refuses the integers at and beside its
    bounds that lie outside it; and what is refused is what llguidance gets wrong (it took the integer)."""
    refused = 0
    for bounds in grid():
        schema = {"type": "number", **bounds}
        n = bounds.get("exclusiveMinimum", bounds.get("exclusiveMaximum"))
        candidates = {json.dumps(c) for c in (n, int(n), int(n) + 1, int(n) - 1)} | {"-0"}
        try:
            check_number_bounds(schema)
        except ValueError:
            refused += 1
            assert any(accepts(schema, c) and not in_range(bounds, c) for c in candidates), bounds
            continue
        wrong = [c for c in candidates if accepts(schema, c) and not in_range(bounds, c)]
        assert not wrong, (bounds, wrong)
    # an integer n (4 of 5) with the other end's integer part n (0.3 and 0.7 away, on the side away from 0:
    # both sides at 0, one side elsewhere), inclusive or open
    assert refused == 8 + 3 * 4


@pytest.mark.parametrize("schema", [
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.5},
    {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 0.01},  # draft 4
    {"type": "integer", "minimum": 9007199254740993, "maximum": 9007199254740995},
    {"type": "integer", "minimum": 2**63, "maximum": 2**63 + 100},
    {"type": "object", "properties": {"p": {"anyOf": [{"type": "string"},
                                                      {"exclusiveMinimum": 2, "maximum": 2.5}]}}},
])
def test_a_bound_llguidance_would_break_is_a_400(app, schema):
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                 {"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
        r = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 8, **body})
        assert r.status_code == 400, (body, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["code"] == "invalid_grammar" and error["param"] == next(iter(body))


@pytest.mark.parametrize("schema", [
    {"type": "number", "exclusiveMinimum": 0},  # a positive number: no other end
    {"type": "number", "exclusiveMinimum": 0, "maximum": 1},  # the other end a whole unit away
    {"type": "number", "exclusiveMinimum": 0.05, "exclusiveMaximum": 0.5},  # non-integer bounds
    {"type": "number", "exclusiveMinimum": -2, "maximum": -1.7},  # the range's integer part is -1
    {"type": "integer", "exclusiveMinimum": 0, "maximum": 1.5},  # integers compile right
    {"type": "number", "minimum": -9007199254740992, "maximum": 9007199254740992},  # +-2**53 itself
    {"type": "object", "properties": {"a": {"const": {"exclusiveMinimum": 0, "maximum": 0.1}}}},  # data
])
def test_bounds_llguidance_enforces_are_served(app, schema):
    r = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0,
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200, r.text[:300]


def nested_any_of(levels: int) -> str:
    """{"anyOf":[{"anyOf":[ ... ]}]} as JSON text, 2 JSON levels a level: built as text, since the client's
    own json.dumps would pass Python's stack first."""
    return '{"anyOf":[' * levels + '{"type":"integer"}' + "]}" * levels


def raw_post(app, path: str, body: str) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, content=body.encode(), headers={"content-type": "application/json"},
                                timeout=60)
    return asyncio.run(go())


DEEP = {
    "response_format": ("/v1/completions",
                        '{"prompt":"x","max_tokens":2,"response_format":{"type":"json_schema",'
                        '"json_schema":{"name":"x","schema":%s}}}'),
    "guided_json": ("/v1/completions", '{"prompt":"x","max_tokens":2,"guided_json":%s}'),
    "tool_choice": ("/v1/chat/completions",
                    '{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"tools":[{"type":"function",'
                    '"function":{"name":"f","parameters":%s}}],"tool_choice":{"type":"function",'
                    '"function":{"name":"f"}}}'),
    "structural_tag": ("/v1/completions",
                       '{"prompt":"x","max_tokens":2,"response_format":{"type":"structural_tag",'
                       '"triggers":["<f"],"structures":[{"begin":"<f>","schema":%s,"end":"</f>"}]}}'),
}


@pytest.mark.parametrize("field", list(DEEP))
def test_a_schema_nested_past_pythons_stack_is_a_400(app, field):
    path, template = DEEP[field]
    for levels in (250, 440, 470, 490):  # a 500 from 250 (a tag's schema) or ~460 levels before
        r = raw_post(app, path, template % nested_any_of(levels))
        assert r.status_code < 500, (field, levels, r.status_code, r.text[:300])
        if r.status_code == 400 and "nests too deeply" in r.text:
            assert r.json()["error"]["code"] == "invalid_grammar"
