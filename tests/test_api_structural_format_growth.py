"""A structural tag's format tree costs the API work linear in its size: each node's grammar is built once
and its rule named wherever it is used (triggered_tags with at_least_one uses each tag's content twice: as
the first tag and among the rest; seven of them nested converted one 7.8 KB grammar node 128 times, 16 s on
a check thread, for a 9 KB request), and a grammar that outgrows MAX_GRAMMAR_CHARS as it is written is
refused then, before more of it is built (a tag's end written after each of 900 leaves made 54 MB in 26 s
before the finished text was refused).

Each request must be answered in LINEAR_S, 5 s: a third of the 16 s the quadratic build took, and 6x the
0.8 s the nested one took at most beside 3 busy processes (idle: 0.2 s; a bound of 2 s left it 2.5x)."""

from __future__ import annotations

import json
import time

import pytest

from server.api.app import create_app
from server.engine.sampling_params import MAX_GRAMMAR_CHARS
from tests.asgi_client import post
from tests.engine_helpers import started_engine
from tests.test_api_structural_format import const, format_grammar
from tests.test_api_structural_tag_bounds import held_loop

pytestmark = pytest.mark.timeout(120)

LINEAR_S = 5.0  # the most a request of these takes to answer (module docstring)
# a GBNF grammar of ~300 rules, under MAX_CFG_CHARS (8 KiB): one conversion takes ~0.1 s
GBNF = "\n".join(["root ::= r0"] + [f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(300)] + ['r300 ::= "z"'])


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=64) as engine:
        yield create_app(engine)


def nested(levels: int, leaf: dict) -> dict:
    node = leaf
    for _ in range(levels):  # 2 nodes a level: 7 levels and the leaf are 15 deep, within MAX_FORMAT_DEPTH
        node = {"type": "triggered_tags", "triggers": ["<a"], "at_least_one": True,
                "tags": [{"begin": "<a>", "content": node, "end": "</a>"}]}
    return node


def test_each_level_of_nested_triggered_tags_adds_the_same_rules():
    lines = [json.loads(format_grammar(nested(levels, const("x"))))["grammars"][0]["lark_grammar"].count("\n")
             for levels in (4, 5, 6, 7)]
    assert lines[1] - lines[0] == lines[2] - lines[1] == lines[3] - lines[2], lines


def test_a_nested_format_embeds_its_grammar_node_once(app):
    fmt = nested(7, {"type": "grammar", "grammar": GBNF})
    held, took, status = held_loop(app, {"prompt": "hi", "max_tokens": 4,
                                         "structured_outputs": {"structural_tag": {"format": fmt}}})
    assert status == 200 and took < LINEAR_S, (f"{took:.1f} s to answer a {len(str(fmt))}-character format "
                                          f"({status}); the API's event loop stalled up to {held:.2f} s")
    grammars = json.loads(format_grammar(fmt))["grammars"]
    assert [g["name"] for g in grammars] == ["format", "g0"]


def test_a_grammar_past_its_bound_is_refused_as_it_grows(app):
    end = "e" * 60000  # written after each of the 900 leaves, the end of the content's free text
    fmt = {"type": "tag", "begin": "<a>", "end": end,
           "content": {"type": "or", "elements": [const("") for _ in range(900)]}}
    start = time.perf_counter()
    r = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                      "response_format": {"type": "structural_tag", "format": fmt}})
    took = time.perf_counter() - start
    assert r.status_code == 400 and f"more than {MAX_GRAMMAR_CHARS} characters" in r.text, r.text
    assert r.json()["error"]["param"] == "response_format"
    assert took < LINEAR_S, f"{took:.1f} s to refuse a grammar past {MAX_GRAMMAR_CHARS} characters"
