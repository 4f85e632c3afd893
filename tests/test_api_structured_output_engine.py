"""Structured outputs end to end: requests through the API to the real tiny engine (its core masks the
logits with the request's grammar), greedy, unary and streamed; the replies match their regex, choice or
schema exactly, and forced tool calls come back with arguments that parse."""

from __future__ import annotations

import json
import re

import pytest

from server.api.app import create_app
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(300)

# bounded structures: a random tiny model finishes them in a few dozen tokens
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["ab", "c"]}},
          "required": ["n", "tag"], "additionalProperties": False}
REGEX = "(yes|no): [a-d]{2,4}!"
CHOICES = ["red", "green", "blue"]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=128) as eng:
        yield create_app(eng)


def follows_schema(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"n", "tag"} and type(value["n"]) is int
            and 0 <= value["n"] <= 99 and value["tag"] in ("ab", "c"))


def text_of(app, path: str, body: dict, stream: bool) -> tuple[str, str]:
    """(the one choice's text, its finish reason), unary or streamed."""
    r = post(app, path, {**body, "temperature": 0, "max_tokens": 48, "stream": stream})
    assert r.status_code == 200, r.text
    chat = path.endswith("chat/completions")
    if not stream:
        choice = r.json()["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    text, finish = "", None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                text += (c["delta"].get("content") or "") if chat else c["text"]
                finish = c["finish_reason"] or finish
    return text, finish


CMPL = ("/v1/completions", {"prompt": "The answer:"})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "The answer?"}]})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", [CMPL, CHAT], ids=["completions", "chat"])
def test_regex_choice_and_schema_are_followed(app, endpoint, stream):
    path, base = endpoint
    text, finish = text_of(app, path, {**base, "structured_outputs": {"regex": REGEX}}, stream)
    assert re.fullmatch(REGEX, text) and finish == "stop", text
    text, finish = text_of(app, path, {**base, "guided_choice": CHOICES}, stream)
    assert text in CHOICES and finish == "stop", text
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    text, finish = text_of(app, path, {**base, "response_format": fmt}, stream)
    assert follows_schema(json.loads(text)) and finish == "stop", text
    assert " " not in text  # compact


def test_unary_and_streamed_replies_are_the_same(app):
    path, base = CMPL
    body = {**base, "guided_json": SCHEMA}
    assert text_of(app, path, body, False) == text_of(app, path, body, True)


def test_json_object_is_an_object(app):
    path, base = CHAT
    text, finish = text_of(app, path, {**base, "response_format": {"type": "json_object"}}, False)
    assert isinstance(json.loads(text), dict) and finish == "stop", text


def merged_calls(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas -> whole calls: a call's first delta names it, the next ones carry further
    pieces of its arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:
            calls[d["index"]] = {"id": d["id"], "function": dict(d["function"])}
        else:
            assert "id" not in d and "name" not in d["function"]
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_have_arguments_that_parse(app, stream):
    path, base = CHAT
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, finish in ((named, "stop"), ("required", "tool_calls")):
        r = post(app, path, {**base, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0,
                             "max_tokens": 64, "stream": stream, "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            deltas = [c["choices"][0] for c in chunks if c["choices"]]
            calls = merged_calls([c for d in deltas for c in d["delta"].get("tool_calls") or []])
            reason = deltas[-1]["finish_reason"]
        else:
            choice = r.json()["choices"][0]
            calls, reason = choice["message"]["tool_calls"], choice["finish_reason"]
            assert choice["message"]["content"] is None
        (call,) = calls
        assert reason == finish
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert arguments in ({"city": "Paris"}, {"city": "Rome"})
        else:
            assert tool_choice == "required" and call["function"]["name"] == "get_time" and arguments == {}


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_the_model_cannot_follow_is_a_400_not_a_retried_500(app, stream):
    """The tiny preset gives every id outside printable ASCII a logit of -inf, so "café" has no token with a
    nonzero probability at its "é": the draw falls outside the grammar and the request fails in the engine.
    That is the request's own failure: a 400 (streamed: an error event of that type), not the engine's 500,
    which the openai SDK retried twice, failing each the same way (a review)."""
    r = post(app, "/v1/completions", {"prompt": "Drink:", "max_tokens": 8, "stream": stream,
                                      "structured_outputs": {"choice": ["café"]}})
    if stream:
        errors = [json.loads(line[6:])["error"] for line in r.text.splitlines()
                  if line.startswith("data: {") and '"error"' in line]
        (error,) = errors
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "structured_output_failed", error
    assert "allows no token the model can produce" in error["message"], error
    r = post(app, "/v1/completions", {"prompt": "Drink:", "max_tokens": 8, "temperature": 0,
                                      "structured_outputs": {"choice": ["cafe"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "cafe", r.text  # the engine serves on
