"""Structured outputs on the API side: each request field becomes the llguidance grammar SamplingParams carry
(response_format, structured_outputs, guided_*, chat tool_choice "required" / named), a bad one is a 400
naming its field, and a forced tool call's reply comes back as tool_calls. The engine is scripted here: what
it receives is checked, and its reply is given."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from server.api.app import create_app
from server.api.errors import APIError
from server.api.forced_tool_calls import ForcedCalls
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.structured_output import grammar_of, json_grammar, validate
from server.engine.grammar import Grammars
from server.model.tokenizer import ByteTokenizer
from tests import test_api_tool_calls
from tests.asgi_client import post
from tests.test_api_tool_calls import chat, streamed

pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def grammar(req) -> tuple[str, str] | None:
    """(grammar text, its field) of a request, validated as the API validates it."""
    tokenizer = ByteTokenizer()
    g = grammar_of(req, tokenizer)
    if g is not None:
        validate(g, tokenizer)
    return None if g is None else (g.text, g.param)


def json_schema_of(text: str) -> dict:
    """The JSON schema a JSON grammar compiles (its compile options too)."""
    (entry,) = json.loads(text)["grammars"]
    return entry["json_schema"]


def test_no_structured_output_and_text_are_no_grammar():
    assert grammar(completion()) is None
    assert grammar(completion(response_format={"type": "text"})) is None
    assert grammar(chat_request(tools=TOOLS, tool_choice="none")) is None
    assert grammar(chat_request(tools=TOOLS, tool_choice="auto")) is None
    assert grammar(completion(structured_outputs={"json_object": False, "regex": "a"})) == (
        LLMatcher.grammar_from_regex("a"), "structured_outputs")


@pytest.mark.parametrize("fields,param,schema", [
    ({"response_format": {"type": "json_object"}}, "response_format", {"type": "object"}),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}},
     "response_format", SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, "response_format",
     {"type": "object"}),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "structured_outputs", SCHEMA),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs", {"type": "object"}),
    ({"guided_json": SCHEMA}, "guided_json", SCHEMA),
    ({"guided_json": json.dumps(SCHEMA)}, "guided_json", SCHEMA),
])
def test_json_fields_compile_their_schema_compact(fields, param, schema):
    for req in (completion(**fields), chat_request(**fields)):
        text, got_param = grammar(req)
        assert got_param == param and json_schema_of(text) == {**schema, "x-guidance":
                                                               {"whitespace_flexible": False}}


def test_a_schemas_own_options_override_the_compact_default():
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    text, _ = grammar(completion(guided_json=schema))
    assert json_schema_of(text)["x-guidance"] == {"whitespace_flexible": True}
    compact = {"whitespace_flexible": False}
    assert json_schema_of(json_grammar(None)) == {"type": "object", "x-guidance": compact}


@pytest.mark.parametrize("kind,value,expected", [
    ("regex", r"\d{3}", LLMatcher.grammar_from_regex(r"\d{3}")),
    ("choice", ["yes", "no", 'say "hi"'], 'start: "yes" | "no" | "say \\"hi\\""'),
    ("grammar", 'start: "a"+', LLMatcher.grammar_from_lark('start: "a"+')),
    ("grammar", 'root ::= "yes" | "no"', None),  # GBNF, converted to Lark
])
def test_vllm_fields_and_their_legacy_names(kind, value, expected):
    text, param = grammar(completion(structured_outputs={kind: value}))
    assert param == "structured_outputs" and (expected is None or text == expected)
    assert grammar(completion(**{f"guided_{kind}": value})) == (text, f"guided_{kind}")


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs"),  # GBNF that fails to convert
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    # two sources
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
])
def test_bad_structured_outputs_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        grammar(completion(**fields))
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {}},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    {"structured_outputs": {"json_object": False}},
    {"structured_outputs": {"choice": []}},
    {"structured_outputs": {"regex": "a", "structural_tag": {  # served, but one constraint only
        "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a"]}}},
    {"structured_outputs": {"structural_tag": {}}},
    {"guided_choice": []},
    {"guided_choice": "a"},
    {"response_format": {"type": "grammar"}},
    {"response_format": {"type": "json_object", "json_schema": {"name": "x"}}},
])
def test_malformed_fields_fail_validation(fields):
    with pytest.raises(ValueError):
        completion(**fields)


def test_tool_choice_named_is_that_functions_parameters():
    text, param = grammar(chat_request(tools=TOOLS, tool_choice=NAMED))
    assert param == "tool_choice" and json_schema_of(text) == {**SCHEMA, "x-guidance":
                                                               {"whitespace_flexible": False}}
    named = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any JSON object
    assert json_schema_of(grammar(chat_request(tools=TOOLS, tool_choice=named))[0])["type"] == "object"


def test_tool_choice_required_is_an_array_of_calls():
    text, param = grammar(chat_request(tools=TOOLS, tool_choice="required"))
    schema = json_schema_of(text)
    assert param == "tool_choice" and schema["type"] == "array" and schema["minItems"] == 1
    assert "maxItems" not in schema
    names = [item["properties"]["name"] for item in schema["items"]["anyOf"]]
    assert names == [{"const": "get_weather"}, {"const": "get_time"}]
    parameters = [item["properties"]["parameters"] for item in schema["items"]["anyOf"]]
    assert parameters == [{"$ref": "#/$defs/tool_0"}, {"$ref": "#/$defs/tool_1"}]
    assert schema["$defs"] == {"tool_0": SCHEMA, "tool_1": {"type": "object"}}
    one = json_schema_of(grammar(chat_request(tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False))[0])
    assert one["maxItems"] == 1


def required_grammar(*parameters: dict) -> str:
    """The "required" grammar over tools f0, f1, ... with these parameters."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": p}}
             for i, p in enumerate(parameters)]
    return grammar(chat_request(tools=tools, tool_choice="required"))[0]


def accepts(grammar_text: str, text: str) -> bool:
    """Whether the grammar, over the byte tokenizer, takes `text` whole and may end there."""
    tok = ByteTokenizer()
    matcher = Grammars(tok, 300, set(tok.eos_token_ids)).compile(grammar_text).result()
    return all(matcher.consume_token(t) for t in tok.encode(text, add_bos=False)) and matcher.is_accepting()


def test_required_rebases_each_tools_root_references_into_its_defs_entry():
    params = {"type": "object", "properties": {"kid": {"$ref": "#"}, "p": {"$ref": "#/$defs/P~1Q"},
                                               "c": {"const": {"$ref": "#"}}},
              "$defs": {"P/Q": {"$ref": "#/properties/c"}}, "x-other": {"$ref": "other.json#/a"}}
    schema = json_schema_of(required_grammar(params))
    assert schema["$defs"]["tool_0"] == {
        "type": "object", "properties": {"kid": {"$ref": "#/$defs/tool_0"},
                                         "p": {"$ref": "#/$defs/tool_0/$defs/P~1Q"},
                                         "c": {"const": {"$ref": "#"}}},  # data, not a reference
        "$defs": {"P/Q": {"$ref": "#/$defs/tool_0/properties/c"}}, "x-other": {"$ref": "other.json#/a"}}


def test_required_keeps_a_recursive_tools_root_ref_at_its_parameters():
    tree = {"type": "object", "additionalProperties": False,
            "properties": {"label": {"type": "string", "maxLength": 3}, "kid": {"$ref": "#"}}}
    g = required_grammar(tree)
    assert accepts(g, '[{"name":"f0","parameters":{"kid":{"label":"a","kid":{}}}}]')
    assert not accepts(g, '[{"name":"f0","parameters":{"kid":[{"name":"f0","parameters":{}}]}}]')


@pytest.mark.parametrize("key", ["$defs", "definitions"])
def test_required_resolves_a_tools_own_definitions(key):
    params = {"type": "object", "properties": {"x": {"$ref": f"#/{key}/X"}}, key: {"X": {"type": "integer"}},
              "required": ["x"], "additionalProperties": False}
    g = required_grammar(params)
    assert accepts(g, '[{"name":"f0","parameters":{"x":1}}]')
    assert not accepts(g, '[{"name":"f0","parameters":{"x":"a"}}]')


def test_required_lets_tools_define_one_name_differently():
    def point(x: dict) -> dict:
        return {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"],
                "additionalProperties": False, "$defs": {"Point": x}}
    g = required_grammar(point({"type": "integer"}), point({"type": "string", "maxLength": 2}))
    assert accepts(g, '[{"name":"f0","parameters":{"p":1}},{"name":"f1","parameters":{"p":"ab"}}]')
    assert not accepts(g, '[{"name":"f0","parameters":{"p":"ab"}}]')
    assert not accepts(g, '[{"name":"f1","parameters":{"p":1}}]')


def test_required_leaves_a_tool_with_its_own_id_as_written():
    tree = {"$id": "https://example.com/tree.json", "type": "object",
            "properties": {"n": {"type": "integer"}, "kid": {"$ref": "#"}}, "additionalProperties": False}
    g = required_grammar(tree)
    assert json_schema_of(g)["$defs"]["tool_0"] == tree  # its "#" already means itself
    assert accepts(g, '[{"name":"f0","parameters":{"kid":{"n":1}}}]')
    assert not accepts(g, '[{"name":"f0","parameters":{"kid":[]}}]')


@pytest.mark.parametrize("fields", [
    {"tool_choice": "required"},  # no tools
    {"tool_choice": NAMED},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
    {"tools": TOOLS, "tool_choice": "required", "guided_json": SCHEMA},  # one structured output a request
])
def test_bad_forced_tool_choices_are_400s(fields):
    with pytest.raises(APIError) as e:
        grammar(chat_request(**fields))
    assert e.value.status == 400 and e.value.param == "tool_choice"


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
@pytest.mark.parametrize("response_format", [
    {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}])
def test_a_forcing_tool_choice_wins_over_response_format(tool_choice, response_format):
    """A review: OpenAI takes the two together (its Agents SDK sends an agent's output type beside
    tool_choice "required"); the turn's reply is calls, so the tools' grammar binds it, as vLLM's does."""
    alone = grammar(chat_request(tools=TOOLS, tool_choice=tool_choice))
    both = grammar(chat_request(tools=TOOLS, tool_choice=tool_choice, response_format=response_format))
    assert both == alone and both[1] == "tool_choice"


def test_forced_replies_parse_into_calls():
    (call,) = ForcedCalls("f").parse('{"a":1}')[1]
    assert (call.name, call.arguments) == ("f", '{"a":1}')
    reply = '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{}}]'
    content, calls = ForcedCalls(None).parse(reply)
    assert content is None  # each call's arguments: its "parameters" text as generated (compact)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a":1}'), ("g", "{}")]
    assert ForcedCalls(None).parse('[{"name":"f","param') == ('[{"name":"f","param', [])  # cut: content
    assert ForcedCalls(None).finish_reason == "tool_calls" and ForcedCalls("f").finish_reason == "stop"


# ---- over HTTP ------------------------------------------------------------------------------------------

ENDPOINTS = [("/v1/completions", {"prompt": "hi"}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]

def scripted(reply: str, seen: list, finish: str = "stop"):
    """engine.generate that records the params it gets and streams `reply` in three deltas per choice."""
    return test_api_tool_calls.scripted(None, reply, pieces=3, seen=seen, finish=finish)


@pytest.mark.parametrize("path,base", ENDPOINTS)
def test_the_grammar_reaches_the_engine(engine, monkeypatch, path, base):
    seen = []
    monkeypatch.setattr(engine, "generate", scripted('{"city":"Paris"}', seen))
    app = create_app(engine)
    for stream in (False, True):
        r = post(app, path, {**base, "max_tokens": 8, "stream": stream, "guided_json": SCHEMA})
        assert r.status_code == 200, r.text
        assert seen.pop().grammar == grammar(completion(guided_json=SCHEMA))[0]
    r = post(app, path, {**base, "max_tokens": 8})
    assert r.status_code == 200 and seen.pop().grammar is None


@pytest.mark.parametrize("path,base", ENDPOINTS)
@pytest.mark.parametrize("fields,param", [
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": ["a"], "allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    # unknown keys, as OpenAI refuses them: a misspelt schema, or a schema given to json_object, were ignored
    # and the reply was free JSON (a review)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schemaa": SCHEMA}}},
     "response_format.json_schema.schemaa"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema"),
])
def test_bad_structured_outputs_are_400s_over_http(engine, path, base, fields, param):
    r = post(create_app(engine), path, {**base, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and "Traceback" not in r.text


def test_a_named_tool_choice_returns_one_call_of_it(engine, monkeypatch):
    seen = []
    monkeypatch.setattr(engine, "generate", scripted('{"city":"Paris"}', seen))
    app = create_app(engine)  # no --enable-auto-tool-choice needed
    for choice in chat(app, tools=TOOLS, tool_choice=NAMED, n=2).json()["choices"]:
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
        assert call["id"].startswith("chatcmpl-tool-")
    assert json_schema_of(seen.pop().grammar)["required"] == ["city"]
    content, calls, finishes = streamed(chat(app, stream=True, tools=TOOLS, tool_choice=NAMED))
    assert content == "" and finishes == ["stop"]
    # OpenAI's form: the call's id, type and name with its first piece, then each next piece of arguments
    first, *rest = calls
    assert len(calls) > 1 and all(c["index"] == 0 for c in calls)
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in rest)
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"Paris"}'


def test_a_required_tool_choice_returns_the_arrays_calls(engine, monkeypatch):
    reply = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'
    monkeypatch.setattr(engine, "generate", scripted(reply, []))
    app = create_app(engine, tool_call_parser="hermes")  # the parser is for "auto" only
    choice = chat(app, tools=TOOLS, tool_choice="required").json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in choice["message"]["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    content, deltas, finishes = streamed(chat(app, stream=True, tools=TOOLS, tool_choice="required"))
    assert content == "" and finishes == ["tool_calls"]
    # each call streams: its id, type and name first, then the pieces of its arguments
    assert [d["function"].get("name") for d in deltas if "id" in d] == ["get_weather", "get_time"]
    assert ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in (0, 1)] == [
        '{"city":"Paris"}', "{}"]
    # parallel_tool_calls false: the grammar allows one call; a reply with more keeps the first
    choice = chat(app, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).json()["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]


def test_a_required_reply_cut_before_its_array_closes(engine, monkeypatch):
    """Unary, it is content; streamed, the calls and pieces already sent stand (a reply cut before its
    first call's name is complete is content)."""
    cut = '[{"name":"get_weather","parameters":{"ci'
    monkeypatch.setattr(engine, "generate", scripted(cut, [], finish="length"))
    app = create_app(engine)
    choice = chat(app, tools=TOOLS, tool_choice="required").json()["choices"][0]
    assert choice["message"]["content"] == cut and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"
    content, deltas, finishes = streamed(chat(app, stream=True, tools=TOOLS, tool_choice="required"))
    assert content == "" and finishes == ["length"] and {d["index"] for d in deltas} == {0}
    assert deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"ci'
    monkeypatch.setattr(engine, "generate", scripted('[{"name":"get_wea', [], finish="length"))
    assert streamed(chat(app, stream=True, tools=TOOLS, tool_choice="required")) == (
        '[{"name":"get_wea', [], ["length"])
