"""Structural tags (vLLM's response_format {"type": "structural_tag", "structures", "triggers"} and
structured_outputs.structural_tag, the object or its JSON text): the grammar each builds takes free text and,
wherever the model writes a trigger, a structure's begin, compact JSON of its schema and its end (checked
with an llguidance matcher over the byte tokenizer); every bad input is a 400 naming its field; the grammar
reaches the engine; and the tiny engine, pushed to write the trigger, follows it end to end."""

from __future__ import annotations

import json

import llguidance
import pytest

from server.api.app import create_app
from server.engine.grammar import LIMITS, vocabulary
from server.engine.sampling_params import MAX_GRAMMAR_CHARS
from server.model.tokenizer import ByteTokenizer
from tests.asgi_client import post
from tests.test_api_structured_output import chat_request, completion, grammar, scripted
from tests.test_api_structured_output_engine import text_of

pytestmark = pytest.mark.timeout(300)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
# two tools in Llama 3.1's <function=NAME> form: one trigger opens both
CALLS = {"structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"},
                        {"begin": "<function=get_time>", "schema": NOTHING, "end": "</function>"}],
         "triggers": ["<function"]}


def matcher(grammar_text: str) -> llguidance.LLMatcher:
    tok = ByteTokenizer()
    m = llguidance.LLMatcher(vocabulary(tok, tok.eos_token_ids), grammar_text, log_level=0, limits=LIMITS)
    assert not m.is_error(), m.get_error()
    return m


def accepts(grammar_text: str, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there."""
    m = matcher(grammar_text)
    return all(m.consume_token(t) for t in ByteTokenizer().encode(text, add_bos=False)) and m.is_accepting()


def refuses(grammar_text: str, text: str) -> bool:
    """Whether the grammar refuses one of `text`'s tokens (the mask would never let the model write it)."""
    m = matcher(grammar_text)
    return not all(m.consume_token(t) for t in ByteTokenizer().encode(text, add_bos=False))


def tag_grammar(tag: dict) -> str:
    text, param = grammar(completion(structured_outputs={"structural_tag": tag}))
    assert param == "structured_outputs"
    return text


# ---- the grammar ----------------------------------------------------------------------------------------

def test_free_text_and_a_structure_wherever_a_trigger_is_written():
    g = tag_grammar(CALLS)
    for text in ["", "No call needed.", "a < b, and functions are fun",
                 'Checking. <function=get_weather>{"city":"Paris"}</function> and '
                 '<function=get_time>{}</function>\nDone.',
                 '<function=get_time>{}</function><function=get_time>{}</function>']:
        assert accepts(g, text), text
    for text in ['<function=get_weather>{"town":"Paris"}',  # a property its schema has not
                 '<function=get_weather>{"city":1}',
                 '<function=get_weather>{ "city":"Paris"}',  # compact: no whitespace between tokens
                 '<function=get_weather>{"city":"Paris"}</func>',  # the end, misspelled
                 "<function=get_news>",  # no structure begins so
                 "I call <functions"]:  # the trigger commits to a begin
        assert refuses(g, text), text
    assert not accepts(g, '<function=get_weather>{"city":"Paris"}')  # not ended: the text cannot stop here


def test_a_begin_that_is_its_trigger_and_an_empty_end():
    g = tag_grammar({"structures": [{"begin": "@", "schema": {"type": "integer"}, "end": ""}],
                     "triggers": ["@"]})
    assert accepts(g, "x = @12 and @3.") and accepts(g, "no trigger")
    assert refuses(g, "mail me @ home") and refuses(g, "@x")


def test_a_structure_opens_at_the_shortest_trigger_its_begin_starts_with():
    """"<f" is written before "<function" is: both structures open at "<f" (under "<function" the second
    would never open)."""
    structures = [{"begin": "<f=a>", "schema": {"type": "integer"}, "end": "</f>"},
                  {"begin": "<function=b>", "schema": {"type": "string"}, "end": "</function>"}]
    g = tag_grammar({"structures": structures, "triggers": ["<function", "<f"]})
    assert accepts(g, '<f=a>1</f> then <function=b>"x"</function>')
    assert refuses(g, "<fun>") and refuses(g, '<f=a>"x"')


def test_a_schemas_own_options_override_the_compact_default():
    loose = {**CITY, "x-guidance": {"whitespace_flexible": True}}
    g = tag_grammar({"structures": [{"begin": "<t>", "schema": loose, "end": "</t>"}], "triggers": ["<t>"]})
    assert accepts(g, '<t>{ "city": "Rome" }</t>')


def test_text_that_looks_like_a_special_token_is_a_text_trigger():
    """A trigger shaped like <...> is text (the byte tokenizer has no such special token)."""
    g = tag_grammar({"structures": [{"begin": "<tool>", "schema": CITY, "end": "</tool>"}],
                     "triggers": ["<tool>"]})
    assert accepts(g, 'Sure: <tool>{"city":"Oslo"}</tool>') and refuses(g, "<tool>hello")


# ---- the request forms ----------------------------------------------------------------------------------

def test_both_request_forms_build_one_grammar():
    text = tag_grammar(CALLS)
    forms = [("response_format", {"response_format": {"type": "structural_tag", **CALLS}}),
             ("structured_outputs", {"structured_outputs": {"structural_tag": json.dumps(CALLS)}}),
             ("structured_outputs", {"structured_outputs": {
                 "structural_tag": json.dumps({"type": "structural_tag", **CALLS})}})]  # vLLM's own text
    for param, fields in forms:
        assert grammar(completion(**fields)) == (text, param)
        assert grammar(chat_request(**fields)) == (text, param)


ENDPOINTS = [("/v1/completions", {"prompt": "hi"}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]
STRUCTURES = CALLS["structures"]


@pytest.mark.parametrize("path,base", ENDPOINTS)
def test_the_grammar_reaches_the_engine(engine, monkeypatch, path, base):
    seen = []
    monkeypatch.setattr(engine, "generate", scripted('<function=get_time>{}</function>', seen))
    app = create_app(engine)
    for fields in ({"response_format": {"type": "structural_tag", **CALLS}},
                   {"structured_outputs": {"structural_tag": CALLS}}):
        for stream in (False, True):
            r = post(app, path, {**base, "max_tokens": 8, "stream": stream, **fields})
            assert r.status_code == 200, r.text
            assert seen.pop().grammar == tag_grammar(CALLS)


def with_structure(**changes) -> dict:
    return {"structures": [{**STRUCTURES[0], **changes}], "triggers": ["<function"]}


@pytest.mark.parametrize("path,base", ENDPOINTS)
@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": STRUCTURES}}, "response_format"),
    ({"response_format": {"type": "json_object", **CALLS}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<"]}},
     "response_format.structures"),
    ({"response_format": {"type": "structural_tag", "structures": STRUCTURES, "triggers": []}},
     "response_format.triggers"),
    ({"response_format": {"type": "structural_tag", "structures": STRUCTURES, "triggers": [""]}},
     "response_format.triggers[0]"),
    ({"response_format": {"type": "structural_tag", "structures": STRUCTURES, "triggers": "<function"}},
     "response_format.triggers"),
    ({"response_format": {"type": "structural_tag", "structures": STRUCTURES, "triggers": ["<tool"]}},
     "response_format"),  # a begin that starts with no trigger
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "end": ""}],
                          "triggers": ["<f>"]}}, "response_format.structures[0].schema"),
    ({"response_format": {"type": "structural_tag", **with_structure(schema="{}")}},
     "response_format.structures[0].schema"),
    ({"response_format": {"type": "structural_tag", **with_structure(begin=3)}},
     "response_format.structures[0].begin"),
    ({"response_format": {"type": "structural_tag", **with_structure(end=None)}},
     "response_format.structures[0].end"),
    ({"response_format": {"type": "structural_tag", **with_structure(schema={"type": "wat"})}},
     "response_format"),  # a schema that does not compile
    ({"response_format": {"type": "structural_tag", **with_structure(schema={**CITY, "x-guidance": 1})}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", **with_structure(
        schema={"enum": [f"value {i}" for i in range(MAX_GRAMMAR_CHARS // 10)]})}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": 3}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": "[1]"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": "[" * 100_000 + "]" * 100_000}},  # json.loads' RecursionError
     "structured_outputs.structural_tag"),  # was a 500 (a review)
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "json_schema", **CALLS})}},
     "structured_outputs.structural_tag.type"),
    ({"structured_outputs": {"structural_tag": {**CALLS, "triggers": ["<tool"]}}},
     "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": with_structure(schema={"type": "wat"})}},
     "structured_outputs"),
    # one structured output a request
    ({"structured_outputs": {"structural_tag": CALLS, "regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", **CALLS}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "structural_tag", **CALLS},
      "structured_outputs": {"structural_tag": CALLS}}, "structured_outputs"),
])
def test_bad_structural_tags_are_400s_naming_the_field(engine, path, base, fields, param):
    r = post(create_app(engine), path, {**base, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and "Traceback" not in r.text, err


def test_a_structural_tag_and_a_forced_tool_choice_are_two_sources(engine):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": NOTHING}}]
    r = post(create_app(engine), "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required",
        "response_format": {"type": "structural_tag", **CALLS}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


# ---- end to end -----------------------------------------------------------------------------------------

# one-byte trigger "<" with a logit bias: the random tiny model writes it whenever the grammar lets it
COUNT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["n"], "additionalProperties": False}
TAG = {"structures": [{"begin": "<t>", "schema": COUNT, "end": "</t>"}], "triggers": ["<"]}
LT = str(ord("<") + ByteTokenizer.OFFSET)
OPENING = '<t>{"n":'  # what the grammar forces once "<" is written


def complete_structures(text: str, finish: str) -> int:
    """How many whole structures `text` holds, asserting that each "<" in it opens "<t>", compact JSON that
    follows COUNT and "</t>" (the last may be cut where the choice ran out of tokens)."""
    whole, rest = 0, text
    while (at := rest.find("<")) >= 0:
        rest = rest[at:]
        head, end, after = rest.partition("</t>")
        if not end:  # cut: what there is begins a structure (its forced start, or more)
            assert finish == "length" and (OPENING.startswith(rest) or rest.startswith(OPENING)), text
            return whole
        assert head.startswith("<t>") and " " not in head, text
        value = json.loads(head[3:])
        assert set(value) == {"n"} and type(value["n"]) is int and 0 <= value["n"] <= 99, text
        whole, rest = whole + 1, after
    return whole


@pytest.mark.parametrize("path,base,fields,stream", [
    ("/v1/completions", {"prompt": "Count:"}, {"response_format": {"type": "structural_tag", **TAG}}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count."}]},
     {"structured_outputs": {"structural_tag": json.dumps(TAG)}}, True),
])
def test_the_tiny_engine_writes_each_structure_whole(app, path, base, fields, stream):
    text, finish = text_of(app, path, {**base, **fields, "logit_bias": {LT: 100}}, stream)
    assert text.startswith("<t>{") and complete_structures(text, finish) >= 2, text
    free, _ = text_of(app, path, {**base, **fields}, stream)  # unbiased: whatever it writes holds
    complete_structures(free, "length")
