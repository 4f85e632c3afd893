"""Structural tags in xgrammar's format form (vLLM's {"type": "structural_tag", "format": {...}}, as
response_format or as structured_outputs.structural_tag, the object or its JSON text): each node type's
grammar takes what the format allows and refuses the rest (checked with an llguidance matcher over the byte
tokenizer); free text ends at the literal after it; a grammar node stays a grammar of its own; every bad or
unserved node, and a tree past the bounds, is a 400 naming its field; and the tiny engine follows each
kind of tree end to end."""

from __future__ import annotations

import json

import pytest

from server.api.app import create_app
from server.api.grammar_texts import MAX_CFG_CHARS
from server.api.structural_format import MAX_FORMAT_CHARS, MAX_FORMAT_DEPTH, MAX_FORMAT_NODES
from tests.asgi_client import post
from tests.engine_helpers import started_engine
from tests.test_api_structural_tag import (
    COUNT,
    ENDPOINTS,
    LT,
    OPENING,
    accepts,
    complete_structures,
    refuses,
)
from tests.test_api_structured_output import chat_request, completion, grammar, scripted
from tests.test_api_structured_output_engine import text_of

pytestmark = pytest.mark.timeout(300)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
INT = {"type": "json_schema", "json_schema": {"type": "integer"}}
ANY = {"type": "any_text"}


def const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def tag(begin: str, content: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def format_grammar(fmt: dict) -> str:
    text, param = grammar(completion(structured_outputs={"structural_tag": {"format": fmt}}))
    assert param == "structured_outputs"
    return text


# two tools in the <function=NAME> form, one trigger for both
TOOLS = [tag("<function=get_weather>", {"type": "json_schema", "json_schema": CITY}, "</function>"),
         tag("<function=get_time>", const("now"), "</function>")]
CALL = '<function=get_weather>{"city":"Paris"}</function>'


# ---- each node type's grammar ---------------------------------------------------------------------------

def test_a_const_string_is_that_string_exactly():
    g = format_grammar(const("Hello <b>!"))  # <b> is text, never a special token
    assert accepts(g, "Hello <b>!")
    assert not accepts(g, "Hello") and refuses(g, "Hello <b>!!") and refuses(g, "Hi")


def test_a_tag_takes_its_begin_compact_json_of_its_schema_and_its_end():
    g = format_grammar(tag("<tool>", {"type": "json_schema", "json_schema": CITY}, "</tool>"))
    assert accepts(g, '<tool>{"city":"Oslo"}</tool>')
    for text in ['<tool>{"town":"Oslo"}', '<tool>{ "city":"Oslo"}', 'x<tool>', '<tool>{"city":"Oslo"}</t>']:
        assert refuses(g, text), text


def test_free_text_in_a_tag_ends_at_the_first_end_and_holds_no_exclude():
    g = format_grammar({"type": "sequence", "elements": [
        tag("<think>", {"type": "any_text", "excludes": ["<function"]}, "</think>"), const("Done.")]})
    assert accepts(g, "<think>a < b, </thin</think>Done.") and accepts(g, "<think></think>Done.")
    assert refuses(g, "<think>x</think>more") and refuses(g, "<think><function")


def test_free_text_before_a_const_string_ends_at_it():
    g = format_grammar({"type": "sequence", "elements": [ANY, const("Answer: "), INT]})
    assert accepts(g, "Let me see. Answer: 42") and accepts(g, "Answer: 7")
    assert refuses(g, "Answer: x")


def test_free_text_alone_runs_to_the_end_of_the_output():
    g = format_grammar({"type": "any_text", "excludes": ["<"]})
    assert accepts(g, "") and accepts(g, "anything\nat all") and refuses(g, "a < b")


def test_triggered_tags_leave_free_text_around_their_tags():
    g = format_grammar({"type": "triggered_tags", "triggers": ["<function="], "tags": TOOLS})
    for text in ["", "No call.", f"Sure. {CALL} and <function=get_time>now</function>\nDone.", CALL + CALL]:
        assert accepts(g, text), text
    for text in ["I call <function=get_news>", '<function=get_weather>{"city":1}', "<function=get_time>soon"]:
        assert refuses(g, text), text
    assert not accepts(g, "<function=get_time>now")  # a tag not ended: the text cannot stop here


@pytest.mark.parametrize("at_least_one,stop_after_first,taken,refused", [
    (False, True, ["", "text", f"text {CALL}"], [f"{CALL} more", f"{CALL}{CALL}"]),
    (True, False, [CALL, f"{CALL} text {CALL} text"], ["text"]),  # a tag first: no text before it
    (True, True, [CALL], ["text", f"{CALL} more"]),  # exactly one tag
])
def test_triggered_tags_flags(at_least_one, stop_after_first, taken, refused):
    g = format_grammar({"type": "triggered_tags", "triggers": ["<function="], "tags": TOOLS,
                        "at_least_one": at_least_one, "stop_after_first": stop_after_first})
    assert all(accepts(g, text) for text in taken), taken
    assert all(refuses(g, text) for text in refused), refused
    assert accepts(g, "") != at_least_one


def test_triggered_tags_in_a_tag_end_at_its_end():
    inner = {"type": "triggered_tags", "triggers": ["<function="], "tags": TOOLS, "excludes": ["<tool"]}
    g = format_grammar({"type": "sequence", "elements": [tag("<calls>", inner, "</calls>"), const("!")]})
    assert accepts(g, f"<calls>text {CALL} text</calls>!") and accepts(g, "<calls></calls>!")
    assert refuses(g, "<calls>a</calls>b") and refuses(g, "<calls><tool")


@pytest.mark.parametrize("at_least_one,stop_after_first,counts", [
    (False, False, [0, 1, 2, 3]),
    (True, False, [1, 2, 3]),
    (False, True, [0, 1]),
    (True, True, [1]),
])
def test_tags_with_separator_take_their_tags_and_nothing_else(at_least_one, stop_after_first, counts):
    """`counts`: how many tags the text may hold."""
    g = format_grammar({"type": "tags_with_separator", "tags": TOOLS, "separator": ",",
                        "at_least_one": at_least_one, "stop_after_first": stop_after_first})
    assert [accepts(g, ",".join([CALL] * n)) for n in range(4)] == [n in counts for n in range(4)]
    assert refuses(g, f"x{CALL}") and refuses(g, f"{CALL} ")


def test_or_takes_any_of_its_elements():
    g = format_grammar({"type": "or", "elements": [const("yes"), {"type": "regex", "pattern": "n(o)+"}, INT]})
    assert all(accepts(g, text) for text in ["yes", "nooo", "-12"])
    assert refuses(g, "maybe") and refuses(g, "no!")


def test_a_grammar_node_is_a_grammar_of_its_own():
    """GBNF is converted; its %ignore applies inside it alone."""
    g = format_grammar({"type": "sequence", "elements": [
        const("A:"), {"type": "grammar", "grammar": 'root ::= "yes" | "no"'}, const(".")]})
    assert accepts(g, "A:yes.") and accepts(g, "A:no.") and refuses(g, "A:maybe")
    g = format_grammar({"type": "sequence", "elements": [
        {"type": "grammar", "grammar": 'start: "a" "b"\n%ignore " "'}, const("c d")]})
    assert accepts(g, "a bc d") and refuses(g, "abc  d")


def test_a_tree_at_the_bounds_compiles():
    deep = const("x")
    for _ in range(MAX_FORMAT_DEPTH - 1):
        deep = {"type": "sequence", "elements": [deep]}
    assert accepts(format_grammar(deep), "x")
    wide = {"type": "or", "elements": [const(f"c{i}") for i in range(MAX_FORMAT_NODES - 1)]}
    assert accepts(format_grammar(wide), "c7")


# ---- the request forms ----------------------------------------------------------------------------------

FORMAT = {"type": "triggered_tags", "triggers": ["<function="], "tags": TOOLS}


def test_both_request_forms_build_one_grammar():
    text = format_grammar(FORMAT)
    tagged = {"type": "structural_tag", "format": FORMAT}
    forms = [("response_format", {"response_format": tagged}),
             ("structured_outputs", {"structured_outputs": {"structural_tag": tagged}}),
             ("structured_outputs", {"structured_outputs": {"structural_tag": json.dumps(tagged)}})]
    for param, fields in forms:
        assert grammar(completion(**fields)) == (text, param)
        assert grammar(chat_request(**fields)) == (text, param)


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=64) as engine:
        yield create_app(engine)


@pytest.mark.parametrize("path,base", ENDPOINTS)
def test_the_grammar_reaches_the_engine(app, monkeypatch, path, base):
    seen = []
    monkeypatch.setattr(app.state.engine, "generate", scripted(CALL, seen))
    for fields in ({"response_format": {"type": "structural_tag", "format": FORMAT}},
                   {"structured_outputs": {"structural_tag": json.dumps({"format": FORMAT})}}):
        r = post(app, path, {**base, "max_tokens": 8, **fields})
        assert r.status_code == 200, r.text
        assert seen.pop().grammar == format_grammar(FORMAT)


def rf(fmt) -> dict:
    return {"response_format": {"type": "structural_tag", "format": fmt}}


@pytest.mark.parametrize("fields,param", [
    (rf({"type": "optional", "content": const("x")}), "response_format.format.type"),  # not served
    (rf({"value": "x"}), "response_format.format.type"),
    (rf("x"), "response_format.format"),
    (rf({"type": "const_string"}), "response_format.format.value"),
    (rf({"type": "const_string", "value": 3}), "response_format.format.value"),
    (rf(tag("<a>", INT, None)), "response_format.format.end"),
    (rf({"type": "tag", "begin": "<a>", "end": ""}), "response_format.format.content"),
    (rf({"type": "sequence", "elements": [const("a"), {"type": "wat"}]}),
     "response_format.format.elements[1].type"),
    (rf({"type": "sequence", "elements": []}), "response_format.format.elements"),
    (rf(tag("<a>", {"type": "json_schema", "json_schema": CITY, "style": "qwen_xml"}, "</a>")),
     "response_format.format.content.style"),  # xgrammar's fields pagewalk does not serve
    (rf({"type": "any_text", "max_tokens": 8}), "response_format.format.max_tokens"),
    (rf({"type": "const_string", "value": "a", "excludes": []}), "response_format.format.excludes"),
    (rf({"type": "any_text", "excludes": [""]}), "response_format.format.excludes[0]"),
    (rf({"type": "regex", "pattern": "a\\"}), "response_format.format"),
    (rf({"type": "sequence", "elements": [ANY, INT]}), "response_format.format"),  # nothing ends the text
    (rf({"type": "sequence", "elements": [FORMAT, INT]}), "response_format.format"),
    (rf({**FORMAT, "triggers": ["<tool"]}), "response_format.format"),  # a tag under no trigger
    (rf({**FORMAT, "triggers": ["<", "<function"]}), "response_format.format"),  # ...under two
    (rf({**FORMAT, "triggers": [""]}), "response_format.format.triggers[0]"),
    (rf({**FORMAT, "tags": [tag("<function=f>", ANY, "")]}), "response_format.format"),  # never ends
    (rf({**FORMAT, "tags": [{**TOOLS[0], "type": "const_string"}]}), "response_format.format.tags[0].type"),
    (rf({"type": "tags_with_separator", "tags": TOOLS}), "response_format.format.separator"),
    # what compiles no grammar: the request's field
    (rf({"type": "regex", "pattern": "(a"}), "response_format"),
    (rf({"type": "json_schema", "json_schema": {"type": "wat"}}), "response_format"),
    (rf({"type": "grammar", "grammar": "root ::= ("}), "response_format"),
    (rf({"type": "sequence", "elements": [{"type": "grammar", "grammar": 'start: "a" @g1'},  # a way out
                                          {"type": "grammar", "grammar": 'start: "b"'}]}), "response_format"),
    # the bounds
    (rf(json.loads('{"type": "sequence", "elements": [' * (MAX_FORMAT_DEPTH + 1) + "{}" + "]}" *
                   (MAX_FORMAT_DEPTH + 1))), "response_format.format"),
    (rf({"type": "or", "elements": [const("c")] * MAX_FORMAT_NODES}), "response_format.format"),
    (rf(const("x" * MAX_FORMAT_CHARS)), "response_format.format"),
    (rf({"type": "or", "elements": [{"type": "grammar", "grammar": 'start: "a"' + " " * (MAX_CFG_CHARS // 2)}
                                    ] * 2}), "response_format.format"),
    # the forms
    (rf(None), "response_format"),
    ({"response_format": {"type": "structural_tag", "format": FORMAT, "triggers": ["<"]}}, "response_format"),
    ({"response_format": {"type": "json_object", "format": FORMAT}}, "response_format"),
    ({"structured_outputs": {"structural_tag": json.dumps({"format": {"type": "nope"}})}},
     "structured_outputs.structural_tag.format.type"),
    ({"structured_outputs": {"structural_tag": {"format": tag("<a>", {"type": "regex"}, "")}}},
     "structured_outputs.structural_tag.format.content.pattern"),
])
def test_bad_formats_are_400s_naming_the_field(app, fields, param):
    r = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and "Traceback" not in r.text, err


# ---- end to end -----------------------------------------------------------------------------------------

CMPL = ("/v1/completions", {"prompt": "Say:"})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say."}]})


@pytest.mark.parametrize("endpoint,stream", [(CMPL, False), (CHAT, True)])
def test_a_const_string_format_makes_the_output_that_string(app, endpoint, stream):
    path, base = endpoint
    text, finish = text_of(app, path, {**base, **rf(const("Hello <world>!"))}, stream)
    assert (text, finish) == ("Hello <world>!", "stop")


@pytest.mark.parametrize("endpoint,stream", [(CMPL, True), (CHAT, False)])
def test_a_tag_of_json_makes_json_that_validates(app, endpoint, stream):
    path, base = endpoint
    fmt = tag("<t>", {"type": "json_schema", "json_schema": COUNT}, "</t>")
    text, finish = text_of(app, path, {**base, "structured_outputs": {"structural_tag": {"format": fmt}}},
                           stream)
    assert finish == "stop" and text.startswith("<t>") and text.endswith("</t>"), text
    value = json.loads(text[3:-4])
    assert set(value) == {"n"} and type(value["n"]) is int and 0 <= value["n"] <= 99, text


def test_a_sequence_of_an_or_makes_one_of_its_choices(app):
    fmt = {"type": "sequence", "elements": [const("Answer: "), {"type": "or", "elements": [
        const("yes"), const("no"), {"type": "regex", "pattern": "maybe [0-9]"}]}, const(".")]}
    text, finish = text_of(app, CMPL[0], {**CMPL[1], **rf(fmt)}, False)
    assert finish == "stop" and text in {"Answer: yes.", "Answer: no."} | {f"Answer: maybe {d}." for d in
                                                                            range(10)}, text


# the trigger "<" (one byte) with a logit bias: the random tiny model writes it wherever the grammar lets it
TRIGGERED = {"type": "triggered_tags", "triggers": ["<"],
             "tags": [tag("<t>", {"type": "json_schema", "json_schema": COUNT}, "</t>")]}


@pytest.mark.parametrize("endpoint,stream", [(CMPL, False), (CHAT, True)])
def test_triggered_tags_make_whole_tags_in_free_text(app, endpoint, stream):
    path, base = endpoint
    text, finish = text_of(app, path, {**base, **rf(TRIGGERED), "logit_bias": {LT: 100}}, stream)
    assert text.startswith(OPENING) and complete_structures(text, finish) >= 2, text
    free, _ = text_of(app, path, {**base, **rf(TRIGGERED)}, stream)  # unbiased: whatever it writes holds
    complete_structures(free, "length")


def test_triggered_tags_with_both_flags_make_exactly_one_tag(app):
    fmt = {**TRIGGERED, "at_least_one": True, "stop_after_first": True}
    text, finish = text_of(app, CHAT[0], {**CHAT[1], **rf(fmt)}, False)
    assert finish == "stop" and text.startswith(OPENING) and complete_structures(text, finish) == 1
    assert text.endswith("</t>"), text
