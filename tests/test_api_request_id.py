"""vLLM's `request_id` and the X-Request-Id header through the HTTP API on the tiny preset: the response's id
(unary and every streamed chunk, n > 1 and several prompts included) carries the client's id, from the body or
else the header; every response echoes X-Request-Id; two requests in flight under one id are both served as
two engine requests whose ids start with the response's; a bad id is a 400 naming the field or header."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import contextmanager

import httpx
import pytest

from server.api.app import create_app
from tests.asgi_client import get, post

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "Hi"}]
ENDPOINTS = [("/v1/completions", {"prompt": "Hi"}, "cmpl-"),
             ("/v1/chat/completions", {"messages": MESSAGES}, "chatcmpl-")]
IDS = ["completions", "chat"]
SHORT = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
HEX32 = re.compile(r"[0-9a-f]{32}")


def chunks(r: httpx.Response) -> list[dict]:
    """The JSON payloads of an SSE body (the [DONE] left out)."""
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", r.text[-200:]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


@contextmanager
def engine_requests(engine):
    """Records the id of every engine request the API makes, and the most in flight at once."""
    seen = {"ids": [], "live": 0, "most": 0}
    generate = engine.generate

    async def recording(request_id, *args, **kwargs):
        seen["ids"].append(request_id)
        seen["live"] += 1
        seen["most"] = max(seen["most"], seen["live"])
        try:
            async for out in generate(request_id, *args, **kwargs):
                yield out
        finally:
            seen["live"] -= 1

    engine.generate = recording
    try:
        yield seen
    finally:
        del engine.generate


@pytest.mark.parametrize("path,fields,prefix", ENDPOINTS, ids=IDS)
def test_the_unary_response_id_and_header_carry_the_body_request_id(app, path, fields, prefix):
    r = post(app, path, {**fields, **SHORT, "n": 2, "request_id": "job-42/a:b"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"{prefix}job-42/a:b"
    assert len(r.json()["choices"]) == 2
    assert r.headers["x-request-id"] == "job-42/a:b"


@pytest.mark.parametrize("path,fields,prefix", ENDPOINTS, ids=IDS)
def test_every_streamed_chunk_carries_the_request_id(app, path, fields, prefix):
    body = {**fields, **SHORT, "n": 2, "stream": True, "stream_options": {"include_usage": True},
            "request_id": "stream-7"}
    r = post(app, path, body)
    assert r.status_code == 200, r.text
    payloads = chunks(r)
    assert len(payloads) > 4 and payloads[-1]["usage"] is not None  # role / text / finish / usage chunks
    assert {p["id"] for p in payloads} == {f"{prefix}stream-7"}
    assert r.headers["x-request-id"] == "stream-7"


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_times_n_share_the_request_id(app, engine, stream):
    body = {"prompt": ["Hi", "Ho"], **SHORT, "n": 2, "stream": stream, "request_id": "batch-1"}
    with engine_requests(engine) as seen:
        r = post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    ids = {p["id"] for p in chunks(r)} if stream else {r.json()["id"]}
    assert ids == {"cmpl-batch-1"}
    assert [re.fullmatch(r"cmpl-batch-1-[0-9a-f]{16}-(\d)", i).group(1) for i in seen["ids"]] == ["0", "1"]


@pytest.mark.parametrize("path,fields,prefix", ENDPOINTS, ids=IDS)
def test_the_header_is_the_request_id_where_the_body_has_none(app, path, fields, prefix):
    r = post(app, path, {**fields, **SHORT}, headers={"X-Request-Id": "trace-9"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"{prefix}trace-9" and r.headers["x-request-id"] == "trace-9"
    # the body's wins for the id; the client's header comes back as it was sent
    r = post(app, path, {**fields, **SHORT, "request_id": "from-body"}, headers={"X-Request-Id": "trace-9"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"{prefix}from-body" and r.headers["x-request-id"] == "trace-9"


@pytest.mark.parametrize("path,fields,prefix", ENDPOINTS, ids=IDS)
@pytest.mark.parametrize("stream", [False, True])
def test_without_an_id_a_fresh_one_is_in_the_response_and_the_header(app, path, fields, prefix, stream):
    r = post(app, path, {**fields, **SHORT, "stream": stream})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert HEX32.fullmatch(rid), rid
    ids = {p["id"] for p in chunks(r)} if stream else {r.json()["id"]}
    assert ids == {f"{prefix}{rid}"}
    assert post(app, path, {**fields, **SHORT}).headers["x-request-id"] != rid


@pytest.mark.parametrize("path,fields,prefix", ENDPOINTS, ids=IDS)
def test_requests_in_flight_under_one_id_are_all_served(app, engine, path, fields, prefix):
    body = {**fields, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "request_id": "same"}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await asyncio.gather(*(c.post(path, json={**body, "stream": s}, timeout=60)
                                          for s in (False, True, False)))

    with engine_requests(engine) as seen:
        responses = asyncio.run(go())
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    assert responses[0].json()["id"] == responses[2].json()["id"] == f"{prefix}same"
    assert {p["id"] for p in chunks(responses[1])} == {f"{prefix}same"}
    for r in (responses[0], responses[2]):
        assert r.json()["usage"]["completion_tokens"] == 24
    assert seen["most"] == 3  # in the engine at once, as three requests
    assert len(set(seen["ids"])) == 3
    assert all(re.fullmatch(rf"{prefix}same-[0-9a-f]{{16}}", i) for i in seen["ids"]), seen["ids"]


@pytest.mark.parametrize("value", ["x" * 256, "!", "~", "0f8fad5b-d9cb-469f-a165-70867728950e",
                                   "trace=abc;span=1,2"])
def test_the_longest_id_and_every_visible_ascii_character_are_accepted(app, value):
    r = post(app, "/v1/completions", {"prompt": "Hi", **SHORT, "request_id": value})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"cmpl-{value}" and r.headers["x-request-id"] == value


@pytest.mark.parametrize("value", ["", "x" * 257, "has space", "tab\there", "line\nbreak", "é", "\x7f",
                                   7, True, ["a"], {"id": "a"}])
@pytest.mark.parametrize("path,fields,prefix", ENDPOINTS, ids=IDS)
def test_a_bad_body_request_id_is_a_400_naming_it(app, path, fields, prefix, value):
    r = post(app, path, {**fields, **SHORT, "request_id": value}, headers={"X-Request-Id": "sent-1"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "request_id" and err["type"] == "invalid_request_error", err
    if isinstance(value, str):
        assert "1 to 256 visible ASCII characters" in err["message"], err
    assert r.headers["x-request-id"] == "sent-1"  # errors carry the header too


@pytest.mark.parametrize("headers", [{"X-Request-Id": "x" * 257}, {"X-Request-Id": "has space"},
                                     {"X-Request-Id": ""}, [("X-Request-Id", "a"), ("X-Request-Id", "b")]],
                         ids=["too-long", "space", "empty", "twice"])
@pytest.mark.parametrize("path,fields,prefix", ENDPOINTS, ids=IDS)
def test_a_bad_header_is_a_400_naming_it_and_is_not_echoed(app, path, fields, prefix, headers):
    for extra in ({}, {"request_id": "ok"}):
        r = post(app, path, {**fields, **SHORT, **extra}, headers=headers)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "X-Request-Id" and "one value of 1 to 256" in err["message"], err
        assert HEX32.fullmatch(r.headers["x-request-id"]), r.headers


def test_other_routes_echo_the_header_or_a_fresh_one(app):
    assert get(app, "/health", headers={"X-Request-Id": "probe-1"}).headers["x-request-id"] == "probe-1"
    assert HEX32.fullmatch(get(app, "/v1/models").headers["x-request-id"])
    assert HEX32.fullmatch(get(app, "/health", headers={"X-Request-Id": "a b"}).headers["x-request-id"])
    r = get(app, "/v1/nowhere", headers={"X-Request-Id": "lost-1"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "lost-1"


def test_auth_refusals_carry_the_header(engine):
    r = post(create_app(engine, api_key="k"), "/v1/completions", {"prompt": "Hi"},
             headers={"X-Request-Id": "no-key-1"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "no-key-1"


def test_a_stream_that_fails_is_logged_under_its_request_id(app, engine, caplog):
    async def failing(request_id, *args, **kwargs):
        raise RuntimeError("the engine broke")
        yield  # an async generator, as AsyncEngine.generate

    engine.generate = failing
    try:
        r = post(app, "/v1/completions", {"prompt": "Hi", **SHORT, "stream": True, "request_id": "doomed-1"})
    finally:
        del engine.generate
    assert r.status_code == 200 and chunks(r)[-1]["error"]["code"] == "internal_error", r.text
    logged = [rec.getMessage() for rec in caplog.records if rec.levelname == "ERROR"]
    assert any("doomed-1" in m for m in logged), logged
