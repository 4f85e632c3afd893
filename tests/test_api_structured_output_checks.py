"""The API checks a structured output against the model's vocabulary with the core's parser limits
(server/engine/grammar.py check), so that what the core could not serve is a 400 naming the field, never a
500 from the core after a prefill; a context-free grammar's text is bounded before llguidance converts it,
and neither building nor checking blocks the event loop (cases from a review)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.api import structured_output
from server.api.app import create_app
from server.api.errors import APIError
from server.api.grammar_texts import MAX_CFG_CHARS
from server.engine import grammar as core_grammar
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(300)
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", dtype="float32", attention_backend="torch",
                        num_blocks=128, block_size=16, max_num_seqs=8, max_num_batched_tokens=256) as engine:
        yield create_app(engine)


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}},
     "structured_outputs"),  # allows no token
    ({"guided_grammar": "root ::= a\na ::= root"}, "guided_grammar"),  # GBNF with no terminal
    ({"guided_grammar": "start: a\na: a"}, "guided_grammar"),  # Lark with no terminal
    ({"guided_grammar": 'start: <|end|> "a"'}, "guided_grammar"),  # a special token the tokenizer lacks
    ({"guided_grammar": "start: <[300]>"}, "guided_grammar"),  # a token id past the vocabulary
    ({"guided_choice": [f"c{i}" for i in range(21_000)]}, "guided_choice"),  # 21,001 Earley items at the
    # first token, over the limit of 20,000 a row
    ({"guided_grammar": 'root ::= "a"\n' * (MAX_CFG_CHARS // 12 + 1)}, "guided_grammar"),  # too long
])
def test_a_grammar_the_core_could_not_serve_is_a_400_naming_its_field(app, body, param):
    r = post(app, COMPLETIONS, {"prompt": "x", "max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_grammar"
    assert len(error["message"]) < 600  # llguidance's messages cut: no parser state, backtrace or grammar


@pytest.mark.parametrize("body,reason", [
    ({"structured_outputs": {"regex": "(a"}}, "unclosed group"),
    ({"guided_regex": "a{5,2}"}, "invalid repetition count range"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "[z-a]"}}}}, "invalid character class range"),
])
def test_a_bad_regex_is_a_400_that_says_why(app, body, reason):
    """llguidance puts a regex's parse error on a line below its caret; the 400 ended at "regex parse
    error:" before (a review with the openai SDK)."""
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **body})
                  if "response_format" in body else (COMPLETIONS, {"prompt": "x", **body}))
    r = post(app, path, {"max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text[:300]
    assert reason in r.json()["error"]["message"], r.json()["error"]["message"]


WIDE = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(500)}}


@pytest.mark.parametrize("body", [
    {"guided_json": WIDE},  # 2,007 items at the first token: over llguidance's default limit, 2,000
    {"guided_json": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 3}, "wrap": WIDE},
                     "required": ["name", "wrap"], "additionalProperties": False}},  # the same, mid-stream
    {"guided_choice": [f"c{i}" for i in range(2500)]},
], ids=["wide", "wide_after_a_property", "2500_choices"])
def test_wide_objects_and_choices_are_served(app, body):
    """Fan-outs that fit MAX_GRAMMAR_CHARS fit the parser limits: they are served, where the limit once bit
    at the first token (a 400) or mid-stream (a 500 after the prefill; a review)."""
    r = post(app, COMPLETIONS, {"prompt": "x", "max_tokens": 40, "temperature": 0, **body})
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")


def test_what_the_check_accepts_the_core_serves(app):
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)},
              "required": ["k0"]}
    r = post(app, COMPLETIONS, {"prompt": "x", "max_tokens": 8, "temperature": 0, "guided_json": schema})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["text"].startswith('{"k0":')


def test_a_slow_grammar_does_not_block_the_event_loop(app):
    """A 3,000-property schema takes the check ~0.3 s on one core; /v1/models answers meanwhile, within 0.25 s
    or an eighth of the whole guided request, whichever is longer: on a loaded box the check's thread holds
    the interpreter longer at a time, and the request grows alike (idle: 4-9 ms of 0.9-1.0 s; beside 3 busy
    processes 4-94 ms of 1.7-5.2 s, against a fixed 0.25). Were the check on the event loop, the answer would
    wait for it, ~30% of the request."""
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(3000)},
              "required": ["k0"]}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            start = time.monotonic()
            slow = asyncio.create_task(c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1,
                                                                 "guided_json": schema}, timeout=120))
            await asyncio.sleep(0.05)  # the POST is parsed and on its way to the check
            t = time.monotonic()
            r = await c.get("/v1/models")
            waited = time.monotonic() - t
            await slow
            return r.status_code, waited, time.monotonic() - start

    status, waited, took = asyncio.run(go())
    assert status == 200 and waited < max(0.25, took / 8), (waited, took)


def counted_checks(monkeypatch) -> list[str]:
    """The grammars the API checks from now on (none kept from before), in order."""
    checks = []
    check = core_grammar.check
    monkeypatch.setattr(core_grammar, "check",
                        lambda vocab, text, forced: checks.append(text) or check(vocab, text, forced))
    structured_output._check.cache_clear()
    return checks


def test_a_grammar_is_checked_once_for_the_requests_that_repeat_it(app, monkeypatch):
    """Clients send one schema with every request: its check's verdict is kept (a bad one's too)."""
    checks = counted_checks(monkeypatch)
    good = {"type": "object", "properties": {"repeated": {"type": "integer"}}, "required": ["repeated"]}
    bad = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    for _ in range(3):
        r = post(app, COMPLETIONS, {"prompt": "x", "max_tokens": 4, "temperature": 0, "guided_json": good})
        assert r.status_code == 200, r.text[:300]
        r = post(app, COMPLETIONS, {"prompt": "x", "max_tokens": 4, "guided_json": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
    assert len(checks) == 2


def test_a_verdict_is_kept_per_cache_salt(app, monkeypatch):
    """A kept verdict answers at once where a large schema's check takes ~0.3 s: tenants that salt apart
    each have the grammar checked (a review: one could time whether another sent the same schema)."""
    checks = counted_checks(monkeypatch)
    schema = {"type": "object", "properties": {"salted": {"type": "integer"}}, "required": ["salted"]}
    for salt in ("tenant-a", "tenant-a", None, "tenant-b", None):
        r = post(app, COMPLETIONS, {"prompt": "x", "max_tokens": 4, "temperature": 0, "guided_json": schema,
                                    "cache_salt": salt})
        assert r.status_code == 200, r.text[:300]
    assert len(checks) == 3


def test_checks_past_the_pending_bound_are_a_429(app, monkeypatch):
    """The API's checks run before admission: their own bound (pending_limit) refuses the excess."""
    monkeypatch.setattr(structured_output, "pending_limit", lambda engine: 0)
    r = post(app, COMPLETIONS, {"prompt": "x", "max_tokens": 2, "guided_regex": "[a-z]+"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "too_many_grammar_checks"
    assert post(app, COMPLETIONS, {"prompt": "x", "max_tokens": 2}).status_code == 200  # no grammar, no check
    assert structured_output._CHECKS.pending == 0


def test_checks_run_on_threads_of_their_own(app, monkeypatch):
    """Not on the event loop's default executor, which shutdown uses (a review: SIGTERM waited 20 s behind
    hung-up clients' checks)."""
    threads = []
    checked = structured_output._checked

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return checked(*args)

    monkeypatch.setattr(structured_output, "_checked", recorded)
    r = post(app, COMPLETIONS, {"prompt": "x", "max_tokens": 2, "guided_regex": "[a-z]+"})
    assert r.status_code == 200 and threads and threads[0].startswith("pagewalk-check")
    assert structured_output._CHECKS.pending == 0


def test_a_check_whose_client_went_away_is_dropped(monkeypatch):
    """A client gone while its grammar waits for a check thread: the check never runs, nothing stays
    pending."""
    ran, gate = [], threading.Event()
    checks = structured_output.GrammarChecks()
    checks.pool = checks.small_pool = ThreadPoolExecutor(1)

    def slow(*args):
        ran.append(args[0])
        gate.wait(5)
        return "grammar"

    monkeypatch.setattr(structured_output, "_checked", slow)

    class Gone:
        async def is_disconnected(self):
            return True

    class Here:
        async def is_disconnected(self):
            return False

    async def scenario():
        busy = asyncio.ensure_future(checks.run(Here(), 8, "busy", None, None))  # holds the one thread
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as gone:
            await checks.run(Gone(), 8, "gone", None, None)
        assert gone.value.status == 499
        gate.set()
        assert await busy == "grammar"

    asyncio.run(scenario())
    checks.pool.shutdown(wait=True)
    assert ran == ["busy"] and checks.pending == 0


def test_a_burst_the_server_would_admit_is_not_refused_by_the_checks(app):
    """64 guided requests at once, one grammar (its verdict kept): none is a 429 (a review: 32 pending checks
    were the bound, below max_num_seqs)."""
    engine = app.state.engine
    assert structured_output.pending_limit(engine) >= engine.max_waiting + engine.config.max_num_seqs

    async def burst():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"prompt": "x", "max_tokens": 1, "guided_regex": "[a-z]+"}
            return await asyncio.gather(*(client.post(COMPLETIONS, json=body) for _ in range(64)))

    answers = asyncio.run(burst())
    assert not [r for r in answers if "too_many_grammar_checks" in r.text]
    assert sum(r.status_code == 200 for r in answers) >= app.state.engine.config.max_num_seqs
    assert structured_output._CHECKS.pending == 0


def test_a_small_grammar_is_not_checked_behind_large_ones(monkeypatch):
    """Sixteen 125K-character schemas took both check threads for 23 s while a regex of a few characters
    waited behind them (a review): a source of up to SMALL_GRAMMAR_CHARS has a thread of its own."""
    from functools import partial

    checks = structured_output.GrammarChecks()
    large = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(600)}}
    assert structured_output._source_chars(partial(structured_output._schema_grammar, large)) > \
        core_grammar.SMALL_GRAMMAR_CHARS

    def slow_when_large(param, build, tokenizer, salt):
        if structured_output._source_chars(build) > core_grammar.SMALL_GRAMMAR_CHARS:
            time.sleep(0.5)
        return param

    monkeypatch.setattr(structured_output, "_checked", slow_when_large)

    class Here:
        async def is_disconnected(self):
            return False

    async def scenario():
        schemas = [asyncio.ensure_future(checks.run(Here(), 16, "large", partial(
            structured_output._schema_grammar, large), None)) for _ in range(6)]
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        small = await checks.run(Here(), 16, "small", partial(structured_output._vllm_grammar, "regex",
                                                              "[a-z]{1,5}"), None)
        took = time.perf_counter() - start
        await asyncio.gather(*schemas)
        return small, took

    small, took = asyncio.run(scenario())
    assert small == "small" and took < 0.4, took  # in one queue: behind 6 x 0.5 s on 2 threads, ~1.5 s
    assert checks.pending == 0


def test_a_check_under_way_when_the_drain_begins_is_a_503(monkeypatch):
    """The drain waits for admitted requests only: a request still in its check was cancelled by uvicorn
    at its deadline, a traceback each in the log (a review). Once the server stops accepting, the check's
    request answers 503 within a poll; the check itself is left to end on its thread."""
    checks = structured_output.GrammarChecks()
    gate = threading.Event()
    monkeypatch.setattr(structured_output, "_checked", lambda *args: gate.wait(5) and "grammar")
    stopping = threading.Event()

    class Here:
        async def is_disconnected(self):
            return False

    async def scenario():
        check = asyncio.ensure_future(checks.run(Here(), 8, "slow", None, None, None, stopping.is_set))
        await asyncio.sleep(0.15)
        assert not check.done()
        stopping.set()
        start = time.perf_counter()
        with pytest.raises(APIError) as stopped:
            await check
        return stopped.value.status, time.perf_counter() - start

    status, took = asyncio.run(scenario())
    gate.set()
    assert status == 503 and took < 1.0 and checks.pending == 0
