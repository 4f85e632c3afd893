"""Chat tool_choice "required", streamed over HTTP: each call goes out as the reply is generated (its id, type
and name once its name is complete, then each piece of its arguments, OpenAI's form), and the pieces join
into the unary reply's arguments, the exact text of each item's "parameters". The engine is scripted: it
streams a given reply in pieces."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from server.api.app import create_app
from tests.asgi_client import post
from tests.test_api_call_array import REPLIES, reply
from tests.test_api_tool_calls import chat, scripted

pytestmark = pytest.mark.timeout(120)

# the scanner's replies whose names a tool may have (OpenAI's pattern: no name needs a JSON escape)
HTTP_REPLIES = {name: calls for name, calls in REPLIES.items() if name != "weird name"}
TOOLS = [{"type": "function", "function": {"name": name}}
         for name in dict.fromkeys(name for calls in HTTP_REPLIES.values() for name, _ in calls)]


@dataclass
class StreamedChoice:
    content: str = ""
    calls: dict[int, dict] = field(default_factory=dict)  # index -> {"id", "name", "arguments", "deltas"}
    finishes: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def streamed_choices(r) -> dict[int, StreamedChoice]:
    """A streamed chat answer per choice, its calls merged from their deltas: a call's first delta carries
    its id, type and name, each next one a piece of its arguments alone."""
    assert r.status_code == 200, r.text
    choices: dict[int, StreamedChoice] = {}
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            choice = choices.setdefault(c["index"], StreamedChoice())
            choice.content += c["delta"].get("content") or ""
            choice.finishes += [c["finish_reason"]] if c["finish_reason"] else []
            choice.token_ids += c.get("token_ids") or []
            for d in c["delta"].get("tool_calls") or []:
                _merge(choice.calls, d)
    return choices


def _merge(calls: dict[int, dict], d: dict) -> None:
    if d["index"] not in calls:
        assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function", d
        assert set(d["function"]) == {"name", "arguments"}, d
        calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"],
                             "arguments": d["function"]["arguments"], "deltas": 1}
        return
    assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
    assert d["function"]["arguments"], d  # a next piece is never empty
    call = calls[d["index"]]
    call["arguments"] += d["function"]["arguments"]
    call["deltas"] += 1


def unary_calls(r) -> tuple[dict, list[tuple[str, str]]]:
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return choice, [(c["function"]["name"], c["function"]["arguments"])
                    for c in choice["message"].get("tool_calls") or []]


@pytest.mark.parametrize("name", HTTP_REPLIES)
@pytest.mark.parametrize("pieces", [1, 4, 10_000])  # 10_000: a character a delta
def test_streamed_and_unary_required_calls_agree(engine, monkeypatch, name, pieces):
    calls = REPLIES[name]
    text, _ = reply(calls)
    monkeypatch.setattr(engine, "generate", scripted(engine, text, pieces=pieces))
    app = create_app(engine)
    choice, unary = unary_calls(chat(app, tools=TOOLS, tool_choice="required"))
    assert unary == calls and choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    (streamed,) = streamed_choices(chat(app, stream=True, tools=TOOLS, tool_choice="required")).values()
    assert streamed.content == "" and streamed.finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.calls.items())] == calls
    assert len({c["id"] for c in streamed.calls.values()}) == len(calls)
    if pieces == 10_000:  # the name's closing quote and each character of the arguments in a delta of its own
        assert [c["deltas"] for _, c in sorted(streamed.calls.items())] == [1 + len(p) for _, p in calls]


def test_each_choice_streams_its_own_calls(engine, monkeypatch):
    calls = REPLIES["three calls"]
    monkeypatch.setattr(engine, "generate", scripted(engine, reply(calls)[0], pieces=7))
    app = create_app(engine)
    choices = streamed_choices(chat(app, stream=True, tools=TOOLS, tool_choice="required", n=2))
    assert sorted(choices) == [0, 1]
    for choice in choices.values():
        assert [(c["name"], c["arguments"]) for _, c in sorted(choice.calls.items())] == calls
    assert not {c["id"] for c in choices[0].calls.values()} & {c["id"] for c in choices[1].calls.values()}


def test_parallel_tool_calls_false_streams_the_first_call_alone(engine, monkeypatch):
    calls = REPLIES["two calls"]
    monkeypatch.setattr(engine, "generate", scripted(engine, reply(calls)[0], pieces=9))
    app = create_app(engine)
    fields = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    assert unary_calls(chat(app, **fields))[1] == calls[:1]
    (streamed,) = streamed_choices(chat(app, stream=True, **fields)).values()
    assert [(c["name"], c["arguments"]) for c in streamed.calls.values()] == calls[:1]
    assert streamed.finishes == ["tool_calls"] and streamed.content == ""


@pytest.mark.parametrize("pieces", [1, 3, 10_000])
def test_a_reply_cut_by_max_tokens_ends_with_what_was_sent(engine, monkeypatch, pieces):
    calls = REPLIES["three calls"]
    text, spans = reply(calls)
    app = create_app(engine)
    # mid-array: before the first name closes, mid-escape, mid-name, between calls, before the "]"
    for cut in (spans[0][0] - 1, text.index("\\") + 1, spans[1][0] - 2, spans[1][2] + 1, len(text) - 1):
        monkeypatch.setattr(engine, "generate", scripted(engine, text[:cut], pieces=pieces, finish="length"))
        choice, unary = unary_calls(chat(app, tools=TOOLS, tool_choice="required"))
        assert unary == [] and choice["message"]["content"] == text[:cut]
        assert choice["finish_reason"] == "length"
        (streamed,) = streamed_choices(chat(app, stream=True, tools=TOOLS, tool_choice="required")).values()
        begun = [k for k, (name_end, _, _) in enumerate(spans) if name_end <= cut]
        assert sorted(streamed.calls) == begun and streamed.finishes == ["length"]
        for k in begun:
            assert streamed.calls[k]["name"] == calls[k][0]
            assert calls[k][1].startswith(streamed.calls[k]["arguments"])
        assert streamed.content == ("" if begun else text[:cut])


def test_text_off_the_arrays_shape_streams_as_content(engine, monkeypatch):
    app = create_app(engine)
    monkeypatch.setattr(engine, "generate", scripted(engine, "no calls here", pieces=3))
    (streamed,) = streamed_choices(chat(app, stream=True, tools=TOOLS, tool_choice="required")).values()
    assert (streamed.content, streamed.calls, streamed.finishes) == ("no calls here", {}, ["stop"])
    monkeypatch.setattr(engine, "generate", scripted(engine, '[{"name":"h","parameters":{}}] and', pieces=3))
    (streamed,) = streamed_choices(chat(app, stream=True, tools=TOOLS, tool_choice="required")).values()
    assert [(c["name"], c["arguments"]) for c in streamed.calls.values()] == [("h", "{}")]
    assert streamed.content == "and" and streamed.finishes == ["tool_calls"]


def test_every_deltas_token_ids_are_streamed(engine, monkeypatch):
    """return_token_ids: a delta whose text gives no call piece yet (the array's own tokens) still goes out,
    with its ids."""
    text, _ = reply(REPLIES["two calls"])
    monkeypatch.setattr(engine, "generate", scripted(engine, text, pieces=10_000))
    r = post(create_app(engine), "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True,
              "tools": TOOLS, "tool_choice": "required", "return_token_ids": True})
    (streamed,) = streamed_choices(r).values()
    assert streamed.token_ids == [3 + k for k in range(len(text))]
    assert [(c["name"], c["arguments"]) for c in streamed.calls.values()] == REPLIES["two calls"]


def test_a_reply_that_stops_before_its_array_closes_is_not_finished_as_calls(engine, monkeypatch):
    """A stop string (or a stop token) ends the reply mid-call: the call that went out is cut, its arguments
    are no JSON, so the stream ends "stop" as the unary reply does (content, no calls), not "tool_calls"
    (a review)."""
    app = create_app(engine)
    cut = '[{"name":"f","parameters":{"city":"Par'
    monkeypatch.setattr(engine, "generate", scripted(engine, cut, pieces=4))
    (unary,) = chat(app, tools=TOOLS, tool_choice="required").json()["choices"]
    assert (unary["finish_reason"], unary["message"]["content"]) == ("stop", cut)
    assert not unary["message"].get("tool_calls")
    (streamed,) = streamed_choices(chat(app, stream=True, tools=TOOLS, tool_choice="required")).values()
    assert [(c["name"], c["arguments"]) for c in streamed.calls.values()] == [("f", '{"city":"Par')]
    assert streamed.finishes == ["stop"]
