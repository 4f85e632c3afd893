"""The work on a request's body (validation, chat template, tokenization) runs in a worker thread for large
bodies, so one client's large prompt does not stand the event loop, and every other stream, still while it
is built; small bodies stay inline (server/api/request_work.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from server.api import request_work
from server.api.app import create_app
from server.api.errors import APIError
from server.api.request_work import INLINE_BODY_BYTES, SMALL_BODY_BYTES, run_request_work
from tests.engine_helpers import started_engine
from tests.test_api_structural_tag_bounds import held_loop

SLOW_S = 0.5  # the template's or the tokenizer's CPU time on a large body, as a thread would spend it


@pytest.fixture(scope="module")
def engine():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=64) as eng:
        yield eng


def _slowed(fn, threads: list[int], delay_s: float = SLOW_S):
    """fn, recording the thread that calls it and taking delay_s longer."""
    def slow(*args, **kwargs):
        threads.append(threading.get_ident())
        time.sleep(delay_s)
        return fn(*args, **kwargs)
    return slow


LARGE = "hello " * (INLINE_BODY_BYTES // 5)  # past the inline limit


@pytest.mark.parametrize("path,body,slowed", [
    ("/v1/completions", {"prompt": LARGE, "max_tokens": 1, "truncate_prompt_tokens": 8}, "encode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LARGE}], "max_tokens": 1,
                              "truncate_prompt_tokens": 8}, "chat_token_ids"),
])
def test_a_large_body_s_prompt_work_leaves_the_event_loop_turning(engine, monkeypatch, path, body, slowed):
    tok, threads = engine.tokenizer, []
    monkeypatch.setattr(tok, slowed, _slowed(getattr(tok, slowed), threads))
    stall, _, status = held_loop(create_app(engine), body, path)
    assert status == 200 and threads and threading.get_ident() not in threads
    assert stall < SLOW_S / 2, f"{path}: the event loop stood still {stall:.2f} s while the prompt was built"


@pytest.mark.parametrize("path,body,slowed", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 1}, "encode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
     "chat_token_ids"),
])
def test_a_small_body_s_prompt_work_runs_inline(engine, monkeypatch, path, body, slowed):
    """No thread hop (~0.26 ms of latency) for the bodies most requests send."""
    tok, threads = engine.tokenizer, []
    monkeypatch.setattr(tok, slowed, _slowed(getattr(tok, slowed), threads, delay_s=0.0))
    app = create_app(engine)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, timeout=60)

    r = asyncio.run(go())
    assert r.status_code == 200 and threads == [threading.get_ident()]


def test_a_large_body_is_validated_off_the_event_loop(engine, monkeypatch):
    import server.api.parsing as parsing

    threads: list[int] = []
    monkeypatch.setattr(parsing, "_load_json", _slowed(parsing._load_json, threads))
    body = {"prompt": LARGE, "max_tokens": 1, "truncate_prompt_tokens": 8}
    stall, _, status = held_loop(create_app(engine), body)
    assert status == 200 and threads and threading.get_ident() not in threads
    assert stall < SLOW_S / 2, f"the event loop stood still {stall:.2f} s while the body was validated"


def test_the_drain_does_not_queue_behind_large_bodies_work(engine, monkeypatch):
    """The request work has threads of its own: the drain (stop_engine: engine.shutdown on asyncio's default
    executor) starts at once while 16 large bodies' tokenization waits for them (a review: in the default
    executor it queued behind them all)."""
    from server.api.app import stop_engine

    tok, threads = engine.tokenizer, []
    monkeypatch.setattr(tok, "encode", _slowed(tok.encode, threads, delay_s=0.3))
    started: dict[str, float] = {}
    monkeypatch.setattr(engine, "shutdown", lambda timeout: started.setdefault("t", time.monotonic()))
    body = {"prompt": LARGE, "max_tokens": 1, "truncate_prompt_tokens": 8}
    app = create_app(engine)

    async def go() -> float:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            posts = [asyncio.ensure_future(c.post("/v1/completions", json=body, timeout=60))
                     for _ in range(16)]
            await asyncio.sleep(0.1)  # the bodies are read, their work queued
            begun = time.monotonic()
            await stop_engine(app)
            await asyncio.gather(*posts, return_exceptions=True)
            return started["t"] - begun

    assert asyncio.run(go()) < 0.3


def test_keyless_tokenize_calls_have_a_thread_of_their_own_and_a_bound(engine, monkeypatch):
    """/tokenize is open without the key where the server has one: 16 keyless large tokenize bodies queued a
    keyed completion's work behind them (0.8-1.4 s, a review). Tokenize calls take their own thread, and past
    UTILITY_PENDING in flight they get a 429; a large completion body's work starts at once meanwhile."""
    from server.api import request_work

    tok, threads = engine.tokenizer, []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", _slowed(encode, threads, delay_s=0.2))
    app = create_app(engine)
    body = {"prompt": LARGE, "max_tokens": 1, "truncate_prompt_tokens": 8}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            flood = [asyncio.ensure_future(c.post("/tokenize", json={"prompt": "word " * 1000}, timeout=60))
                     for _ in range(request_work.UTILITY_PENDING + 4)]
            await asyncio.sleep(0.1)
            monkeypatch.setattr(tok, "encode", encode)  # the completion's own encode is quick
            start = time.monotonic()
            completion = await c.post("/v1/completions", json=body, timeout=60)
            waited = time.monotonic() - start
            return [r.status_code for r in await asyncio.gather(*flood)], completion.status_code, waited

    statuses, completion, waited = asyncio.run(go())
    assert sorted(statuses) == [200] * request_work.UTILITY_PENDING + [429] * 4
    assert completion == 200 and waited < 0.5, waited  # not behind 8 x 0.2 s of tokenize work


class BodyRequest:
    """What run_request_work reads of a request: its body, and whether its client has gone."""

    def __init__(self, size: int, gone_after_s: float | None = None):
        self.raw, self.start, self.gone_after_s = b" " * size, time.monotonic(), gone_after_s

    async def body(self) -> bytes:
        return self.raw

    async def is_disconnected(self) -> bool:
        return self.gone_after_s is not None and time.monotonic() - self.start >= self.gone_after_s


def test_a_gone_clients_queued_work_never_runs():
    """24 clients that sent 1 MB bodies and hung up held a 6 KB body's work 3.9 s (a review): work whose
    client is gone before a thread takes it never runs (a 499), and bodies up to SMALL_BODY_BYTES have threads
    of their own, so the 6 KB body does not queue behind the large ones either."""
    ran: list[float] = []

    def work(delay_s: float) -> None:
        time.sleep(delay_s)
        ran.append(delay_s)

    async def go():
        gone = [asyncio.ensure_future(run_request_work(BodyRequest(1 << 20, gone_after_s=0.05), work, 0.3))
                for _ in range(12)]
        await asyncio.sleep(0.01)
        start = time.monotonic()
        await run_request_work(BodyRequest(6000), work, 0.0)  # the small lane: no wait behind the large
        small_s = time.monotonic() - start
        outcomes = await asyncio.gather(*gone, return_exceptions=True)
        return small_s, outcomes

    small_s, outcomes = asyncio.run(go())
    assert small_s < 0.2, small_s
    assert all(isinstance(o, APIError) and o.status == 499 for o in outcomes), outcomes
    # the large lane's threads took their first bodies before the clients went; the rest never ran
    assert ran.count(0.3) <= request_work._WORKERS._max_workers
    assert 6000 <= SMALL_BODY_BYTES < 1 << 20


def test_a_client_gone_before_its_work_is_queued_costs_no_thread():
    ran = []
    with pytest.raises(APIError) as e:
        asyncio.run(run_request_work(BodyRequest(1 << 20, gone_after_s=0.0), ran.append, 1))
    assert e.value.status == 499 and ran == []


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 4, "logprobs": 5, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "logprobs": True, "top_logprobs": 5}),
])
def test_a_non_streamed_answer_with_logprobs_is_built_off_the_event_loop(engine, monkeypatch, path, body):
    """Its models and JSON (up to max_logprob_entries records: a million took 1.1 s of the loop, stalling
    every stream: a review) are built in a worker thread; an answer without logprobs inline."""
    from server.api import chat, completions

    module = completions if path == "/v1/completions" else chat
    threads: list[int] = []
    monkeypatch.setattr(module, "_response_body", _slowed(module._response_body, threads))
    stall, _, status = held_loop(create_app(engine), body, path)
    assert status == 200 and threads and threading.get_ident() not in threads
    assert stall < SLOW_S / 2, f"{path}: the event loop stood still {stall:.2f} s while the answer was built"
    threads.clear()
    plain = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    _, _, status = held_loop(create_app(engine), plain, path)
    assert status == 200 and threads == [threading.get_ident()]


def test_a_large_json_answer_is_written_in_slices():
    from server.api.streaming import BODY_SLICE_BYTES, SlicedResponse

    sent = []

    async def send(message):
        sent.append(message)

    body = bytes(range(256)) * (BODY_SLICE_BYTES // 100)
    asyncio.run(SlicedResponse(content=body)({"type": "http"}, None, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-length", str(len(body)).encode()) in sent[0]["headers"]
    parts = [m["body"] for m in sent[1:]]
    assert b"".join(parts) == body and max(map(len, parts)) == BODY_SLICE_BYTES and len(parts) == 4
    assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]
