"""Every bad input gets a 4xx with an OpenAI error body; failures never leak a traceback."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from server.api.app import create_app
from server.api.async_engine import AsyncEngine
from server.engine.engine import EngineConfig
from server.model.chat_template import ChatTemplate
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(model="tiny", device="cpu", attention_backend="torch", num_blocks=64)


@pytest.fixture(scope="module")
def engine():
    with started_engine(**CFG) as eng:
        yield eng


def request(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, timeout=60, **kw)
    return asyncio.run(go())


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param, err
    assert "Traceback" not in r.text
    return err


CMPL = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

BAD_COMPLETIONS = [
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "", "add_special_tokens": False}, "prompt"),  # no BOS: no token to read
    ({"prompt": ["a", ""], "add_special_tokens": False}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [1, 999999]}, "prompt"),
    ({"prompt": [[1, 2], [-1]]}, "prompt"),
    ({**CMPL, "logit_bias": {"five": 100}}, "logit_bias"),
    ({**CMPL, "best_of": 3}, "best_of"),  # more than n: ranking candidates is not implemented
    ({**CMPL, "n": 2, "best_of": 1}, "best_of"),  # fewer than n
    ({**CMPL, "response_format": {"type": "xml"}}, "response_format.type"),
    ({**CMPL, "response_format": {"type": "json_schema"}}, "response_format"),  # no json_schema
    ({**CMPL, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                         "schema": {"type": 1}}}},
     "response_format"),
    ({**CMPL, "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats"),
    ({**CMPL, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options"),
    ({**CMPL, "return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
    ({**CMPL, "detokenize": 0}, "detokenize"),
    ({**CMPL, "detokenize": False, "stop": "x"}, "stop"),  # stop strings are found in the text
    ({**CMPL, "detokenize": False, "stop": ["x", "y"], "stream": True}, "stop"),
    ({**CMPL, "logits_processors": ["x"]}, "logits_processors"),
    ({**CMPL, "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({**CMPL, "priority": 1}, "priority"),  # vLLM's priority scheduling: silently ignored before
    ({**CMPL, "kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),  # likewise
    ({**CMPL, "vllm_xargs": {"threshold": 0.5}}, "vllm_xargs"),  # likewise
    ({**CMPL, "max_tokens": 0}, "max_tokens"),
    ({**CMPL, "max_tokens": -3}, "max_tokens"),
    ({**CMPL, "max_tokens": "5"}, "max_tokens"),
    ({**CMPL, "max_tokens": 2.5}, "max_tokens"),
    ({**CMPL, "temperature": -0.1}, "temperature"),
    ({**CMPL, "temperature": "hot"}, "temperature"),
    ({**CMPL, "top_p": 0}, "top_p"),
    ({**CMPL, "top_p": 1.5}, "top_p"),
    ({**CMPL, "n": 0}, "n"),
    ({**CMPL, "logprobs": 21}, "logprobs"),
    ({**CMPL, "stream": "yes"}, "stream"),
    ({**CMPL, "stop": 3}, "stop"),
    ({**CMPL, "stop_token_ids": [100000]}, "stop_token_ids"),
    ({**CMPL, "presence_penalty": 3}, "presence_penalty"),
    ({**CMPL, "repetition_penalty": 0}, "repetition_penalty"),
    ({**CMPL, "seed": "x"}, "seed"),
    ({**CMPL, "suffix": "tail"}, "suffix"),
    ({**CMPL, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CMPL, "stream": False, "stream_options": {}}, "stream_options"),
    ({**CMPL, "min_tokens": 3.5}, "min_tokens"),
    ({**CMPL, "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({**CMPL, "skip_special_tokens": "no"}, "skip_special_tokens"),  # a bool (false spells them)
    ({**CMPL, "guided_json": {"type": "wat"}}, "guided_json"),
    ({**CMPL, "guided_regex": "(unclosed"}, "guided_regex"),
    # a lone trailing backslash: llguidance drops it, which served "ab\\" as /ab/
    ({**CMPL, "guided_regex": "ab\\"}, "guided_regex"), ({**CMPL, "guided_regex": "\\"}, "guided_regex"),
    ({**CMPL, "structured_outputs": {"regex": "a\\\\\\"}}, "structured_outputs"),
    ({**CMPL, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({**CMPL, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({**CMPL, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),  # vLLM's: not with a stream
    ({**CMPL, "add_special_tokens": "yes"}, "add_special_tokens"),
]

BAD_CHATS = [
    ({"max_tokens": 2}, "messages"),
    ({"messages": []}, "messages"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # no parser
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),  # only an assistant's turn may lack content
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),  # no tools
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({**CHAT, "tool_choice": "any"}, "tool_choice"),
    ({**CHAT, "detokenize": False, "stop": ["x"]}, "stop"),
    ({**CHAT, "detokenize": False, "tools": [TOOL], "tool_choice": "required"}, "tool_choice"),  # calls: text
    ({**CHAT, "detokenize": False, "tools": [TOOL], "stream": True,
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ({**CHAT, "echo": True}, "echo"),
    ({**CHAT, "store": True}, "store"),
    ({**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ({**CHAT, "audio": {"voice": "x"}}, "audio"),
    ({**CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
    ({**CHAT, "continue_final_message": True}, "continue_final_message"),
    ({**CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({**CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
]
NO_OP_FIELDS = [  # OpenAI fields at the value that asks for nothing: accepted
    ("/v1/completions", {**CMPL, "suffix": None, "stream_options": None, "min_tokens": 0,
                         "skip_special_tokens": True, "include_stop_str_in_output": False}),
    ("/v1/completions", {**CMPL, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {**CMPL, "n": 2, "best_of": 2, "response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "tool_calls": [{"id": "c1"}]},
                                           {"role": "tool", "content": "42", "tool_call_id": "c1"}],
                              "max_tokens": 2}),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "none", "store": False, "modalities": ["text"],
                              "echo": False, "functions": [], "metadata": {"k": "v"},
                              "service_tier": "auto"}),
    # detokenize false with what needs no text: stop token ids, tools shown and not called
    ("/v1/completions", {**CMPL, "detokenize": False, "stop_token_ids": [5], "stop": []}),
    ("/v1/chat/completions", {**CHAT, "detokenize": False, "tools": [TOOL], "tool_choice": "none"}),
    ("/v1/completions", {**CMPL, "detokenize": None, "return_tokens_as_token_ids": None, "stop": "x"}),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(engine, body, param):
    err = assert_error(request(create_app(engine), "POST", "/v1/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_requests_are_400(engine, body, param):
    assert_error(request(create_app(engine), "POST", "/v1/chat/completions", json=body), 400, param)


def test_auto_tool_calls_without_detokenize_are_400(engine):
    app = create_app(engine, tool_call_parser="hermes")
    r = request(app, "POST", "/v1/chat/completions", json={**CHAT, "detokenize": False, "tools": [TOOL]})
    assert "detokenize false" in assert_error(r, 400, "tool_choice")["message"]


@pytest.mark.parametrize("path,body", NO_OP_FIELDS)
def test_unimplemented_fields_at_their_no_op_value_are_accepted(engine, path, body):
    r = request(create_app(engine), "POST", path, json=body)
    assert r.status_code == 200, r.text


def test_unknown_fields_are_ignored(engine):
    r = request(create_app(engine), "POST", "/v1/completions",
                json={**CMPL, "user": "u1", "some_future_field": {"x": 1}, "best_of": 1, "priority": 0,
                      "kv_transfer_params": None, "vllm_xargs": {}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b'"a string"', b"\xff\xfe"])
def test_malformed_body_is_400(engine, content):
    r = request(create_app(engine), "POST", "/v1/completions", content=content,
                headers={"content-type": "application/json"})
    assert_error(r, 400, None)


def test_unknown_model_is_404(engine):
    r = request(create_app(engine), "POST", "/v1/completions", json={**CMPL, "model": "gpt-9"})
    err = assert_error(r, 404, "model")
    assert err["code"] == "model_not_found"


def test_an_empty_model_name_and_top_logprobs_0_ask_for_nothing(engine):
    """As vLLM takes them (a review): "model": "" is the served model, and top_logprobs 0 without logprobs
    asks for nothing (above 0 it needs logprobs)."""
    app = create_app(engine)
    r = request(app, "POST", "/v1/completions", json={**CMPL, "model": ""})
    assert r.status_code == 200 and r.json()["model"] == engine.model_name, r.text
    r = request(app, "POST", "/v1/chat/completions", json={**CHAT, "top_logprobs": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


def test_an_empty_text_prompt_is_its_bos(engine):
    """As vLLM serves it: "" tokenizes to BOS, a prompt (a review: refused before tokenizing); an empty list
    of ids stays a 400."""
    app = create_app(engine)
    for prompt in ("", ["", "a"]):
        r = request(app, "POST", "/v1/completions", json={**CMPL, "prompt": prompt, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == [engine.tokenizer.bos_token_id]


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_template_rendering_no_token_is_a_400_naming_messages(engine, monkeypatch, stream):
    """The engine's admission refused it naming "prompt", a field chat has not (a review)."""
    monkeypatch.setattr(engine.tokenizer, "chat_template",
                        ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", "test"))
    body = {**CHAT, "messages": [{"role": "user", "content": ""}], "add_special_tokens": False,
            "stream": stream}
    r = request(create_app(engine), "POST", "/v1/chat/completions", json=body)
    err = assert_error(r, 400, "messages")
    assert "no token" in err["message"]


def test_tool_choice_required_over_no_tools_calls_nothing(engine):
    """As vLLM aligns it with OpenAI: "required" with tools [] is "none" (a review: a 400); with no tools
    list at all it is a 400 naming tool_choice."""
    app = create_app(engine)
    r = request(app, "POST", "/v1/chat/completions", json={**CHAT, "tools": [], "tool_choice": "required"})
    assert r.status_code == 200 and not r.json()["choices"][0]["message"].get("tool_calls"), r.text
    r = request(app, "POST", "/v1/chat/completions", json={**CHAT, "tool_choice": "required"})
    assert_error(r, 400, "tool_choice")


def test_prompt_plus_max_tokens_too_long_names_max_tokens_and_both_numbers(engine):
    r = request(create_app(engine), "POST", "/v1/completions",
                json={"prompt": "hello", "max_tokens": engine.max_model_len})
    err = assert_error(r, 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"
    numbers = re.findall(r"\d+", err["message"])
    assert str(len(engine.tokenizer.encode("hello"))) in numbers and str(engine.max_model_len) in numbers
    r = request(create_app(engine), "POST", "/v1/chat/completions",
                json={**CHAT, "max_completion_tokens": engine.max_model_len})
    assert assert_error(r, 400, "max_completion_tokens")["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {}, "messages"),
])
def test_prompt_alone_too_long_names_the_prompt(engine, path, body, param):
    text = "x" * engine.max_model_len
    messages = [{"role": "user", "content": text}]
    body = {**body, "prompt": text} if param == "prompt" else {"messages": messages}
    err = assert_error(request(create_app(engine), "POST", path, json=body), 400, param)
    assert err["code"] == "context_length_exceeded" and str(engine.max_model_len) in err["message"]


def test_unknown_route_404_and_wrong_method_405(engine):
    app = create_app(engine)
    assert_error(request(app, "GET", "/v1/nope"), 404)
    assert_error(request(app, "POST", "/nothing/here", json={}), 404)
    assert_error(request(app, "GET", "/v1/completions"), 405)
    assert_error(request(app, "DELETE", "/v1/chat/completions"), 405)


def test_body_size_limit_413(engine):
    app = create_app(engine, max_body_bytes=200)
    big = {"prompt": "x" * 500, "max_tokens": 1}
    err = assert_error(request(app, "POST", "/v1/completions", json=big), 413)
    assert err["code"] == "request_too_large"

    async def chunked():  # no Content-Length: the streamed size is counted
        for _ in range(10):
            yield b" " * 50

    assert_error(request(app, "POST", "/v1/completions", content=chunked()), 413)
    assert request(app, "POST", "/v1/completions", json=CMPL).status_code == 200


def test_bearer_auth(engine):
    app = create_app(engine, api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Basic s3cret"}):
        err = assert_error(request(app, "POST", "/v1/completions", json=CMPL, headers=headers), 401)
        assert err["type"] == "authentication_error"
    assert_error(request(app, "GET", "/v1/models"), 401)
    assert_error(request(app, "GET", "/v1/models/tiny"), 401)
    ok = {"Authorization": "Bearer s3cret"}
    assert request(app, "POST", "/v1/completions", json=CMPL, headers=ok).status_code == 200
    assert request(app, "GET", "/v1/models", headers=ok).status_code == 200
    assert request(app, "GET", "/health").status_code == 200  # probes need no key
    # auth is checked before the body is looked at
    assert_error(request(app, "POST", "/v1/completions", content=b"{bad"), 401)


def test_queue_full_is_429_with_retry_after():
    with started_engine(**CFG, max_waiting=0) as eng:
        r = request(create_app(eng), "POST", "/v1/completions", json=CMPL)
        err = assert_error(r, 429)
        assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1


def test_shutting_down_is_503():
    eng = AsyncEngine(EngineConfig(**CFG), in_process=True)
    eng.start()
    eng.shutdown(timeout=5)
    app = create_app(eng)
    health = request(app, "GET", "/health")
    assert health.status_code == 503 and health.json()["status"] == "shutting_down"
    assert_error(request(app, "POST", "/v1/completions", json=CMPL), 503)


def test_unexpected_exception_is_a_generic_500(engine, monkeypatch):
    def boom(*_a, **_k):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(engine.tokenizer, "encode", boom)
    r = request(create_app(engine), "POST", "/v1/completions", json=CMPL)
    err = assert_error(r, 500)
    assert "secret" not in r.text and err["type"] == "server_error"


def test_engine_side_error_is_500_or_an_error_event(engine, monkeypatch):
    def broken_execute(*_a, **_k):
        raise RuntimeError("device fell off")

    monkeypatch.setattr(engine.client.core.runner, "execute", broken_execute)
    app = create_app(engine)
    err = assert_error(request(app, "POST", "/v1/completions", json=CMPL), 500)
    assert err["code"] == "engine_error"
    r = request(app, "POST", "/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_error"
    monkeypatch.undo()
    assert request(app, "POST", "/v1/completions", json=CMPL).status_code == 200


def test_a_request_cancelled_by_the_servers_stop_gets_an_openai_503():
    """uvicorn cancels what still runs when its graceful shutdown times out (a core that stopped answering):
    the client reads an OpenAI 503 body instead of uvicorn's plain-text 500, and the cancellation goes on."""
    from server.api.errors import CatchAllMiddleware

    async def stuck(scope, receive, send):
        raise asyncio.CancelledError

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def go():
        with pytest.raises(asyncio.CancelledError):
            await CatchAllMiddleware(stuck)({"type": "http", "method": "POST", "path": "/v1/completions"},
                                            receive, send)

    asyncio.run(go())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "shutting_down"
