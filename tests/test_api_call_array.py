"""The scan of a "required" reply's array of calls (server/api/call_array.py): cut anywhere, a reply gives
each call's name once its string is complete and exactly the text of its "parameters" value, piece by piece,
the same calls as the unary parse; a cut reply gives what it got to; text off the array's shape is content."""

from __future__ import annotations

import json
from itertools import combinations, pairwise

import pytest

from server.api.call_array import CallArrayScanner, CallPiece
from server.api.forced_tool_calls import ForcedCalls

pytestmark = pytest.mark.timeout(120)


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


NESTED = ("get_weather", compact({"city": "Paris", "when": {"day": [1, 2.5e-3, {"h": None}], "ok": True}}))
STRINGS = ("f", compact({"s": '}]{["\\ \\"', "t": "a\\\\b\"", "u": "\\u0041 ]", "": ""}))
UNICODE = ("g", compact({"city": "Zürich — 東京 😀", "n": -1}))
ESCAPED_UNICODE = ("g", json.dumps({"city": "é 😀"}, separators=(",", ":")))  # \u00e9 \ud83d\ude00
EMPTY = ("h", "{}")
WEIRD_NAME = ('we"ird\\näme', compact({"a": []}))
SCALARS = [("n", "12"), ("s", '"x]},\\""'), ("l", "[1,[2],{}]"), ("t", "true"), ("z", "null")]

REPLIES = {
    "nested": [NESTED],
    "strings": [STRINGS],
    "unicode": [UNICODE],
    "escaped unicode": [ESCAPED_UNICODE],
    "empty": [EMPTY],
    "weird name": [WEIRD_NAME],
    "two calls": [NESTED, EMPTY],
    "three calls": [STRINGS, UNICODE, EMPTY],
    "scalar parameters": SCALARS,
}


def reply(calls: list[tuple[str, str]]) -> tuple[str, list[tuple[int, int, int]]]:
    """The compact array of these (name, parameters text) calls, as the grammar writes it, and per call
    (the index past its name's closing quote, where its parameters' text starts, where it ends)."""
    text, spans = "[", []
    for k, (name, parameters) in enumerate(calls):
        text += ("," if k else "") + '{"name":' + json.dumps(name, ensure_ascii=False)
        name_end = len(text)
        text += ',"parameters":'
        spans.append((name_end, len(text), len(text) + len(parameters)))
        text += parameters + "}"
    return text + "]", spans


def expected_pieces(text: str, calls: list[tuple[str, str]], spans, a: int, b: int) -> list[CallPiece]:
    """What text[a:b] gives: a call whose name closes in it begins (with the parameters text it holds); a
    call begun before it gets the part of its parameters text it holds."""
    pieces = []
    for k, (name_end, start, end) in enumerate(spans):
        if a < name_end <= b:
            pieces.append(CallPiece(k, calls[k][0], text[start:min(b, end)] if start < b else ""))
        elif name_end <= a and max(a, start) < min(b, end):
            pieces.append(CallPiece(k, None, text[max(a, start):min(b, end)]))
    return pieces


def partitions(n: int):
    """Cut points of text of length n: each single cut, each pair of cuts, and every character apart."""
    yield from ([c] for c in range(n + 1))
    yield from ([c, d] for c, d in combinations(range(1, n), 2))
    yield list(range(1, n))


def spans_of(text: str, cuts: list[int]) -> list[tuple[int, int]]:
    """The pieces of text these cut points make, as (start, end)."""
    return list(pairwise([0, *cuts, len(text)]))


def fed(scanner: CallArrayScanner, text: str, cuts: list[int]) -> list[tuple[list[CallPiece], str]]:
    """What the scanner gives for each piece of text between these cut points."""
    return [scanner.feed(text[a:b]) for a, b in spans_of(text, cuts)]


def scanned(text: str, cuts: list[int]) -> list[tuple[list[CallPiece], str]]:
    scanner = CallArrayScanner()
    out = fed(scanner, text, cuts)
    assert scanner.complete and scanner.finish() == ""
    return out


@pytest.mark.parametrize("name", REPLIES)
def test_pieces_cut_anywhere_give_each_calls_name_and_parameters_text(name):
    calls = REPLIES[name]
    text, spans = reply(calls)
    for cuts in partitions(len(text)):
        expected = [(expected_pieces(text, calls, spans, a, b), "") for a, b in spans_of(text, cuts)]
        assert scanned(text, cuts) == expected, cuts


@pytest.mark.parametrize("name", REPLIES)
def test_the_unary_parse_gives_the_same_calls(name):
    calls = REPLIES[name]
    text, _ = reply(calls)
    content, parsed = ForcedCalls(None).parse(text)
    assert content is None and [(c.name, c.arguments) for c in parsed] == calls
    assert [json.loads(c.arguments) for c in parsed] == [json.loads(p) for _, p in calls]


@pytest.mark.parametrize("name", ["three calls", "weird name", "scalar parameters"])
def test_a_cut_reply_gives_what_it_got_to(name):
    calls = REPLIES[name]
    text, spans = reply(calls)
    for cut in range(len(text)):
        for cuts in ([], list(range(1, cut))):  # the cut text whole, and a character at a time
            scanner = CallArrayScanner()
            out = fed(scanner, text[:cut], cuts)
            content = "".join(c for _, c in out) + scanner.finish()
            got: dict[int, list[str]] = {}
            for piece in (p for pieces, _ in out for p in pieces):
                assert (piece.index not in got) == (piece.name is not None)
                got.setdefault(piece.index, []).append(piece.arguments)
            begun = [k for k, (name_end, _, _) in enumerate(spans) if name_end <= cut]
            assert sorted(got) == begun and not scanner.complete
            for k in begun:
                assert calls[k][1].startswith("".join(got[k]))
            assert content == ("" if begun else text[:cut])  # no call yet: the cut text is content
        assert ForcedCalls(None).parse(text[:cut]) == (text[:cut], [])


@pytest.mark.parametrize("text,calls,content", [
    ('{"name":"f","parameters":{}}', [], '{"name":"f","parameters":{}}'),  # no array
    ('[{"parameters":{},"name":"f"}]', [], '[{"parameters":{},"name":"f"}]'),  # keys out of order
    ("[1]", [], "[1]"),
    ("[]", [], "[]"),
    ('[{"name":f}]', [], '[{"name":f}]'),  # a name that is no string
    ('[{"name":"\\x","parameters":{}}]', [], '[{"name":"\\x","parameters":{}}]'),  # no JSON escape
    ("plain text", [], "plain text"),
    ('[{"name":"f","parameters":{}}]x', [("f", "{}")], "x"),  # after a call: content from where it goes off
    ('[{"name":"f","parameters":{}} x]', [("f", "{}")], "x]"),
    ('[{"name":"f","parameters":}]', [("f", "")], "}]"),
    ('[{"name":"f","parameters":{}},{"name":"g","parameters":{}}garbage', [("f", "{}"), ("g", "{}")],
     "garbage"),
    ('[{"name":"f","parameters":{}},]', [("f", "{}")], "]"),
])
def test_text_off_the_shape_is_content(text, calls, content):
    for cuts in ([], list(range(1, len(text)))):
        scanner = CallArrayScanner()
        out = fed(scanner, text, cuts)
        got: list[list[str]] = []
        for piece in (p for pieces, _ in out for p in pieces):
            if piece.name is not None:
                got.append([piece.name, ""])
            got[-1][1] += piece.arguments
        assert "".join(c for _, c in out) + scanner.finish() == content and not scanner.complete
        assert [tuple(c) for c in got] == calls
    assert ForcedCalls(None).parse(text) == (text, [])


def test_whitespace_between_the_arrays_tokens_is_skipped_and_kept_inside_values():
    text = ' [ {"name" : "f" ,\n "parameters" : {"a": [1, 2]} } , {"name":"g","parameters": 7 } ] \n'
    scanner = CallArrayScanner()
    pieces, content = scanner.feed(text)
    assert content == "" and scanner.complete
    assert pieces == [CallPiece(0, "f", '{"a": [1, 2]}'), CallPiece(1, "g", "7")]
    (_, parsed) = ForcedCalls(None).parse(text)
    assert [(c.name, c.arguments) for c in parsed] == [("f", '{"a": [1, 2]}'), ("g", "7")]


def test_a_long_reply_in_one_character_pieces_is_read_once():
    """Each character is read once: a long value's pieces come back one by one, nothing is held."""
    parameters = compact({"code": 'print("}]\\\\") ' * 5000, "list": list(range(2000))})
    text, _ = reply([("f", parameters)])
    scanner = CallArrayScanner()
    out = [scanner.feed(c) for c in text]
    assert scanner.complete and scanner.held == []
    assert "".join(p.arguments for pieces, _ in out for p in pieces) == parameters
