"""Tool-call parsing (server/api/tool_calls.py): the hermes and llama3_json formats, replies that are not
calls, and the streamed splitter against the whole-reply parse over every split of the text."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.api.tool_calls import PARSERS, ToolCallStream, parse
from server.cli import TOOL_CALL_PARSERS

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'


def calls_of(parser: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse(parser, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_the_cli_offers_the_parsers_there_are():
    assert TOOL_CALL_PARSERS == PARSERS


@pytest.mark.parametrize("text,content,calls", [
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    (f"Let me check.\n<tool_call>{WEATHER}</tool_call>", "Let me check.\n",
     [("get_weather", {"city": "Paris", "unit": "c"})]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": [1, 2]}}</tool_call>', None, [("a", {}), ("b", {"x": [1, 2]})]),
    (f"<tool_call>{WEATHER}", None, [("get_weather", {"city": "Paris", "unit": "c"})]),  # cut at the end
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>', None, [("a", {"k": 1})]),
    ("no calls here", "no calls here", []),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "a"}</tool_call><tool_call>oops</tool_call>',
     '<tool_call>{"name": "a"}</tool_call><tool_call>oops</tool_call>', []),  # one bad call: all content
])
def test_hermes(text, content, calls):
    assert calls_of("hermes", text) == (content, calls)


@pytest.mark.parametrize("text,content,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    (' \n{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": 2}}', None,
     [("a", {}), ("b", {"y": 2})]),
    ('<|python_tag|>{"name": "a", "parameters": {"q": "x"}}', None, [("a", {"q": "x"})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),  # cut: not JSON
    ('{"answer": 42}', '{"answer": 42}', []),  # a JSON reply that is no call
])
def test_llama3_json(text, content, calls):
    assert calls_of("llama3_json", text) == (content, calls)


def test_each_call_gets_its_own_id():
    _, calls = parse("hermes", f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>")
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)


REPLIES = {
    "hermes": ["plain text, no calls", f"Checking <tool_call>{WEATHER}</tool_call>",
               f"<tool_call>{WEATHER}</tool_call>", "a < b <tool_ and <tool_calls are text",
               "<tool_call>{bad"],
    "llama3_json": ['{"name": "a", "parameters": {"k": "v"}}', "  just words", '  {"answer": 1}',
                    '<|python_tag|>{"name": "b", "parameters": {}}', "<|pyth not the tag"],
}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_streaming_sends_what_the_whole_reply_parses_to(data):
    """Whatever the split of the reply into deltas, the text streamed plus the held text and the calls at
    the end are the whole reply's content and calls; no text that belongs to a call is streamed."""
    parser = data.draw(st.sampled_from(PARSERS))
    text = data.draw(st.sampled_from(REPLIES[parser]))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ToolCallStream(parser)
    sent = "".join(stream.feed(p) for p in pieces)
    held, calls = stream.finish()
    content, want = parse(parser, text)
    if want:
        assert sent + held == (content or "") and [(c.name, c.arguments) for c in calls] == \
            [(c.name, c.arguments) for c in want]
    else:
        assert sent + held == text and calls == []


@pytest.mark.parametrize("parser,wrap", [("hermes", "<tool_call>{}</tool_call>"), ("llama3_json", "{}"),
                                         ("llama3_json", '{{"name": "f", "parameters": {{"x": {}}}}}')])
def test_a_reply_nested_past_pythons_stack_is_content(parser, wrap):
    """json.loads raises RecursionError, not a JSONDecodeError, on a reply of 100,000 '[': the model's text
    is then content, not a 500 (a call's arguments nested so deep, in llama3_json: a 500 before, a review)."""
    text = wrap.format("[" * 100_000 + "]" * 100_000)
    assert parse(parser, text) == (text, [])


@pytest.mark.parametrize("parser,wrap", [
    ("hermes", '<tool_call>{{"name": "f", "arguments": {}}}</tool_call>'),
    ("llama3_json", '{{"name": "f", "parameters": {}}}')])
def test_no_depth_near_pythons_stack_makes_the_parse_raise(parser, wrap):
    """Arguments nested just short of the recursion limit decode, and their json.dumps, one frame deeper,
    raised (a review of the fix above: llama3_json's dump was outside its try, a 500 at a band of depths)."""
    limit = sys.getrecursionlimit()
    for depth in range(limit - 150, limit + 10):
        text = wrap.format("[" * depth + "]" * depth)
        content, calls = parse(parser, text)
        assert (content, calls) == (text, []) or [c.name for c in calls] == ["f"], depth


def _strict_json(text: str):
    """json.loads refusing NaN / Infinity, as a client's strict parser (JSON.parse) does."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>'),  # past the float range
    ("llama3_json", '{"name": "f", "parameters": {"x": -1e400}}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),  # no JSON
    ("llama3_json", '{"name": "f", "parameters": {"x": Infinity}}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "city=Paris"}</tool_call>'),  # a string, no JSON text
])
def test_a_call_whose_arguments_are_no_json_is_content(parser, text):
    """Python's json reads NaN and writes 1e400 back as Infinity: such a call was sent with arguments that
    strict parsers refuse (a review); it is the reply's content, as any call that is no JSON."""
    assert parse(parser, text) == (text, [])
    stream = ToolCallStream(parser)
    sent = stream.feed(text)
    held, calls = stream.finish()
    assert sent + held == text and calls == []


@pytest.mark.parametrize("args,expected", [('"{\\"city\\": \\"Paris\\"}"', {"city": "Paris"}),
                                           ('{"x": 1.5e300, "n": -0}', {"x": 1.5e300, "n": 0})])
def test_arguments_are_strict_json_text(args, expected):
    """Arguments written as a string of JSON text are that JSON; numbers in range stay numbers."""
    _, (call,) = parse("hermes", f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>')
    assert _strict_json(call.arguments) == expected


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"city": "\\ud800 é"}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"city": "\\ud800 é"}}'),
])
def test_a_lone_surrogate_escape_stays_an_escape(parser, text):
    """json.loads makes an unpaired surrogate of "\\ud800", which UTF-8 cannot encode: the unary reply was
    a 500 and the stream stopped (a review). The arguments keep the escape, so they encode and decode back."""
    _, (call,) = parse(parser, text)
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == {"city": "\ud800 é"}


def test_a_name_with_a_lone_surrogate_makes_the_call_content():
    text = '<tool_call>{"name": "f\\udc00", "arguments": {}}</tool_call>'
    assert parse("hermes", text) == (text, [])
