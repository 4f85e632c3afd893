"""stream_options.continuous_usage_stats (vLLM's): with include_usage, every streamed chunk before the usage
chunk carries the request's usage so far: prompt_tokens (every prompt once), completion_tokens (summed over
the choices, so it never goes down and ends at the usage chunk's), total_tokens. Without include_usage it
asks for nothing, as in vLLM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.api.app import create_app
from server.api.chat import ChatJob
from server.api.engine_stream import StreamedChoice, streamed_choices
from server.api.protocol import ChatCompletionRequest
from server.api.streaming import ChunkFrame
from server.engine.sampling_params import SamplingParams
from tests import test_api_tool_calls
from tests.asgi_client import post
from tests.test_api_openai import sse_payloads
from tests.test_api_tool_calls import CALL, TOOLS

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0, "ignore_eos": True}
USAGE_OPTIONS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CONTINUOUS = {"stream": True, **USAGE_OPTIONS}
MESSAGES = [{"role": "user", "content": "hello there"}]


def usage_stream(r) -> tuple[list[dict], dict]:
    """(the chunks before the usage chunk, the final usage) of a continuous-usage stream, checking that
    every chunk carries a usage whose completion_tokens never go down and end at the final usage's."""
    assert r.status_code == 200, r.text
    *chunks, last = sse_payloads(r.text)
    assert chunks and last["choices"] == []
    final = last["usage"]
    counts = []
    for c in chunks:
        u = c["usage"]
        assert set(u) == {"prompt_tokens", "completion_tokens", "total_tokens"}, c
        assert u["prompt_tokens"] == final["prompt_tokens"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        counts.append(u["completion_tokens"])
    assert counts == sorted(counts) and counts[-1] == final["completion_tokens"]
    assert chunks[-1]["usage"] == final
    return chunks, final


def ids_so_far(chunks: list[dict]) -> list[int]:
    """Per chunk, the token ids (return_token_ids) the stream has sent up to and including it."""
    sent, out = 0, []
    for c in chunks:
        sent += sum(len(ch.get("token_ids") or []) for ch in c["choices"])
        out.append(sent)
    return out


@pytest.mark.parametrize("return_token_ids", [False, True])
def test_completion_chunks_carry_the_usage_so_far_over_prompts_and_n(app, engine, return_token_ids):
    ids = engine.tokenizer.encode("abc", add_bos=True)
    req = {"prompt": [ids, ids + [70, 71]], "n": 2, "max_tokens": 5, "return_token_ids": return_token_ids,
           **GREEDY}
    whole = post(app, "/v1/completions", req).json()
    chunks, final = usage_stream(post(app, "/v1/completions", {**req, **CONTINUOUS}))
    assert final == whole["usage"] == {"prompt_tokens": 2 * len(ids) + 2, "completion_tokens": 20,
                                       "total_tokens": 2 * len(ids) + 22}
    assert {ch["index"] for c in chunks for ch in c["choices"]} == {0, 1, 2, 3}
    assert all(len(c["choices"]) == 1 for c in chunks)
    if return_token_ids:  # each chunk counts exactly the tokens sent so far, its own included
        assert [c["usage"]["completion_tokens"] for c in chunks] == ids_so_far(chunks)


@pytest.mark.parametrize("fields", [{"echo": True}, {"echo": True, "logprobs": 1}, {"logprobs": 2}])
def test_echo_and_logprob_chunks_carry_it(app, fields):
    req = {"prompt": "Echo me", "max_tokens": 4, "n": 2, **GREEDY, **fields}
    whole = post(app, "/v1/completions", req).json()
    chunks, final = usage_stream(post(app, "/v1/completions", {**req, **CONTINUOUS}))
    assert final == whole["usage"] and final["completion_tokens"] == 8
    if fields.get("echo") and "logprobs" not in fields:  # the echoes come first: nothing generated yet
        assert [c["usage"]["completion_tokens"] for c in chunks[:2]] == [0, 0]
    if "logprobs" in fields:
        assert all(c["choices"][0]["logprobs"] for c in chunks if c["usage"]["completion_tokens"])


def test_chat_role_content_and_finish_chunks_carry_it(app):
    req = {"messages": MESSAGES, "max_tokens": 6, "n": 3, "return_token_ids": True, **GREEDY}
    whole = post(app, "/v1/chat/completions", req).json()
    chunks, final = usage_stream(post(app, "/v1/chat/completions", {**req, **CONTINUOUS}))
    assert final == whole["usage"] and final["completion_tokens"] == 18
    roles, rest = chunks[:3], chunks[3:]
    assert [c["choices"][0]["delta"] for c in roles] == [{"role": "assistant", "content": ""}] * 3
    assert all(c["usage"]["completion_tokens"] == 0 for c in roles)
    assert roles[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert final["prompt_tokens"] == len(whole["prompt_token_ids"])
    assert [c["usage"]["completion_tokens"] for c in rest] == ids_so_far(rest)
    finishes = [c for c in rest if c["choices"][0]["finish_reason"]]
    assert len(finishes) == 3 and all(c["choices"][0]["finish_reason"] == "length" for c in finishes)


def test_chat_logprob_chunks_carry_it(app):
    req = {"messages": MESSAGES, "max_tokens": 5, "n": 2, "logprobs": True, "top_logprobs": 1, **GREEDY}
    whole = post(app, "/v1/chat/completions", req).json()
    chunks, final = usage_stream(post(app, "/v1/chat/completions", {**req, **CONTINUOUS}))
    assert final == whole["usage"] and final["completion_tokens"] == 10
    assert all(c["choices"][0]["logprobs"]["content"] for c in chunks[2:])


@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": "Hello"}),
                                       ("/v1/chat/completions", {"messages": MESSAGES})])
def test_stop_strings_count_what_the_usage_chunk_counts(app, path, base):
    req = {**base, "max_tokens": 12, "n": 2, "return_token_ids": True, **GREEDY}
    text = _text(post(app, path, req).json()["choices"][0])
    stop = text[3:5]
    assert len(stop) == 2 and text.index(stop) == 3  # the choices stop early, on a string
    whole = post(app, path, {**req, "stop": stop}).json()
    assert all(c["finish_reason"] == "stop" and _text(c) == text[:3] for c in whole["choices"])
    chunks, final = usage_stream(post(app, path, {**req, "stop": stop, **CONTINUOUS}))
    assert final == whole["usage"] and final["completion_tokens"] < 24
    generated = [c for c in chunks if "role" not in c["choices"][0].get("delta", {})]
    assert [c["usage"]["completion_tokens"] for c in generated] == ids_so_far(generated)


def streamed_text(chunks: list[dict]) -> str:
    """A stream's choice-0 text, its chunks joined (a chat chunk's delta content, a completion's text)."""
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks)


def _text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": "Hello"}),
                                       ("/v1/chat/completions", {"messages": MESSAGES})])
def test_alone_it_asks_for_usage_and_include_usage_false_still_wins(app, path, base):
    """As in vLLM, whose include_usage defaults to true: continuous_usage_stats alone gives the running
    usage and the usage chunk (a review: before, it gave nothing); with include_usage false, neither."""
    req = {**base, "max_tokens": 3, **GREEDY}
    plain = sse_payloads(post(app, path, {**req, "stream": True}).text)
    alone = post(app, path, {**req, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert alone.status_code == 200, alone.text
    chunks = sse_payloads(alone.text)
    # (how many tokens a chunk carries follows the engine's pace: compare the streams' text, not chunk counts)
    assert all(c["usage"] is not None for c in chunks) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert streamed_text(chunks[:-1]) == streamed_text(plain)
    off = sse_payloads(post(app, path, {**req, "stream": True, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}}).text)
    assert all("usage" not in c and c["choices"] for c in off)  # no usage, no usage-only chunk
    assert streamed_text(off) == streamed_text(plain)
    off = sse_payloads(post(app, path, {**req, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": False}}).text)
    assert all(c["usage"] is None for c in off[:-1]) and off[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": "Hello"}),
                                       ("/v1/chat/completions", {"messages": MESSAGES})])
def test_unstreamed_requests_refuse_it(app, path, base):
    """stream_options of any kind is only allowed with stream true (a 400 naming it, as for include_usage)."""
    r = post(app, path, {**base, "max_tokens": 2, "stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def scripted_app(engine, monkeypatch, reply: str, **app_args):
    monkeypatch.setattr(engine, "generate", test_api_tool_calls.scripted(engine, reply, pieces=4))
    return create_app(engine, **app_args)


@pytest.mark.parametrize("reply", [CALL, "Let me look.\n" + CALL])
def test_tool_call_chunks_carry_it(engine, monkeypatch, reply):
    app = scripted_app(engine, monkeypatch, reply, tool_call_parser="hermes")
    r = test_api_tool_calls.chat(app, stream=True, tools=TOOLS, n=2, **USAGE_OPTIONS)
    chunks, final = usage_stream(r)
    parts = -(-len(reply) // (len(reply) // 4))  # the scripted deltas per choice, one token each
    assert final["completion_tokens"] == 2 * parts
    calls = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert len(calls) == 2 and all(c["choices"][0]["finish_reason"] == "tool_calls" for c in calls)
    assert test_api_tool_calls.streamed(r)[2] == ["tool_calls", "tool_calls"]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_tool_call_chunks_carry_it(engine, monkeypatch, tool_choice):
    reply = ('[{"name":"get_weather","parameters":{"city":"Paris"}}]' if tool_choice == "required"
             else '{"city":"Paris"}')
    app = scripted_app(engine, monkeypatch, reply)
    r = test_api_tool_calls.chat(app, stream=True, tools=TOOLS, tool_choice=tool_choice,
                                 **USAGE_OPTIONS)
    chunks, final = usage_stream(r)
    assert final["completion_tokens"] >= 4
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)


def test_a_stream_without_it_pays_nothing_per_delta():
    """Without continuous usage the frame is the plain one (fixed tail) and the choices plain StreamedChoices:
    the hot path does what it did before."""
    for options in ({}, {"stream_options": {"include_usage": True}},
                    {"stream_options": {"include_usage": False, "continuous_usage_stats": True}}):
        req = ChatCompletionRequest(messages=MESSAGES, stream=True, **options)
        job = ChatJob(SimpleNamespace(model_name="tiny"), req, "chatcmpl-x", 1, [1, 2], SamplingParams())
        assert job.running_usage is None and type(job.frame) is ChunkFrame
        assert all(type(s) is StreamedChoice for s in streamed_choices([0, 0], job.running_usage))
