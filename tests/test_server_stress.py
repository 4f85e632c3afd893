"""Stress: a seeded random mix of concurrent requests, client cancellations and aborts at every lifecycle
stage, on a KV cache small enough to force chunked prefill, preemption and fork failures. Afterwards the
engine must be drained (no used blocks, nothing running or waiting), its KV cache intact, and still serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass, field

import httpx
import pytest

from server.api.app import create_app
from server.api.async_engine import AsyncEngine
from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.request import Request
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import SeqStatus
from tests.engine_helpers import started_engine, wait_until

pytestmark = pytest.mark.timeout(120)

CFG = dict(model="tiny", device="cpu", dtype="float32", block_size=16, num_blocks=32, max_num_seqs=8,
           max_num_batched_tokens=64, max_model_len=256, attention_backend="torch")
PREFIXES = ["The quick brown fox jumps over the lazy dog. " * 2, "Once upon a time, in a paged cache, "]
STOPS = ["e", "zz", "th", "x" * 256]  # the longest a stop string may be (RequestLimits)


@pytest.fixture(scope="module")
def engine():
    with started_engine(**CFG) as eng:
        yield eng


def assert_drained(engine: AsyncEngine) -> None:
    """Nothing in flight, no block held, the block tables consistent, the engine thread alive."""

    def drained() -> bool:
        h = engine.health()
        return h["kv_cache"]["used_blocks"] == 0 and h["running"] == 0 and h["waiting"] == 0

    assert wait_until(drained, timeout=10), engine.health()
    core = engine.client.core
    assert not core.requests and not engine._live
    core.kv.check_integrity()
    assert engine.client.is_alive()


# ---- the random mix --------------------------------------------------------------------------------------

@dataclass
class Job:
    path: str
    body: dict
    n: int  # choices expected
    admissible: bool
    mode: str  # "finish" | "cancel" (cancel the client task) | "disconnect" (client goes away mid-response)
    delay: float = 0.0  # cancel / disconnect after this many seconds
    result: dict = field(default_factory=dict)


def random_job(rng: random.Random, engine: AsyncEngine) -> Job:
    body = _sampling_fields(rng)
    kind = rng.random()
    if kind < 0.15:  # near the context limit: token ids, n = 1
        body.update(n=1, max_tokens=rng.randint(1, 8))
        num_prompt = CFG["max_model_len"] - body["max_tokens"] - rng.randint(0, 2)
        body["prompt"] = [rng.randint(3, 258) for _ in range(num_prompt)]
    else:
        _add_prompt(rng, body)
    if 0.15 <= kind < 0.25:  # n choices beyond the whole KV cache
        body.update(n=4, max_tokens=120)
    mode = rng.choices(["finish", "cancel", "disconnect"], [0.6, 0.2, 0.2])[0]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    num_choices = body["n"] * len(_prompts(body, engine.tokenizer))
    return Job(path, body, num_choices, _fits(body, engine), mode, rng.uniform(0, 0.5))


def _sampling_fields(rng: random.Random) -> dict:
    body = {"max_tokens": rng.randint(1, 40), "stream": rng.random() < 0.5, "n": rng.randint(1, 4),
            "return_token_ids": True, "ignore_eos": rng.random() < 0.7,
            "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.4:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.3:
        body.update(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                    repetition_penalty=rng.uniform(0.5, 2))
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**40)
    return body


def _add_prompt(rng: random.Random, body: dict) -> None:
    """A chat or completions prompt sharing a prefix with others (prefix-cache hits), maybe with logprobs."""
    text = rng.choice(PREFIXES) + "".join(rng.choices("abcdefgh ", k=rng.randint(0, 20)))
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        return
    body["prompt"] = text if rng.random() < 0.7 else [text, rng.choice(PREFIXES)]
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)


def _prompts(body: dict, tokenizer) -> list[list[int]]:
    """The token ids of each prompt of the request (one engine request each)."""
    if "messages" in body:
        return [tokenizer.encode(tokenizer.apply_chat_template(body["messages"]))]
    prompt = body["prompt"]
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        prompt = [prompt]
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]


def _fits(body: dict, engine: AsyncEngine) -> bool:
    totals = [len(p) + body["max_tokens"] for p in _prompts(body, engine.tokenizer)]
    # the KV check adds up every prompt of the request (RequestLimits / check_limits)
    return all(t <= engine.max_model_len for t in totals) \
        and sum(totals) * body["n"] <= engine.capacity_tokens


async def call_asgi(app, path: str, body: dict, disconnect_after: float | None,
                    spec_version: str = "2.3") -> tuple[int, bytes]:
    """Drives the ASGI app like a server would; the client disconnects after `disconnect_after` s. ASGI
    spec 2.4 servers report that by raising OSError from send (older ones only through receive)."""
    sent: list[dict] = []
    gone = asyncio.Event()
    payload = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if payload:
            return payload.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set() and spec_version >= "2.4":
            raise OSError("client disconnected")
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "server": ("t", 80),
             "client": ("c", 1)}
    if disconnect_after is not None:
        asyncio.get_running_loop().call_later(disconnect_after, gone.set)
    await asyncio.wait_for(app(scope, receive, send), timeout=60)  # a client going away is no app error
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), "gone")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def run_job(app, job: Job) -> None:
    if job.mode == "disconnect":
        spec = "2.4" if job.delay < 0.25 else "2.3"
        job.result["status"], _ = await call_asgi(app, job.path, job.body, job.delay, spec)
        return
    task = asyncio.create_task(call_asgi(app, job.path, job.body, None))
    if job.mode == "cancel":
        await asyncio.sleep(job.delay)
        task.cancel()
    try:
        job.result["status"], job.result["body"] = await task
    except asyncio.CancelledError:
        job.result["status"] = "cancelled"


def choices_of(job: Job, raw: bytes) -> dict[int, dict]:
    """index -> {"token_ids", "finish_reason"} from a JSON body or an SSE stream."""
    if not job.body.get("stream"):
        body = json.loads(raw)
        usage = body["usage"]["completion_tokens"]
        assert usage == sum(len(c["token_ids"]) for c in body["choices"])
        return {c["index"]: c for c in body["choices"]}
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    out: dict[int, dict] = {}
    for event in events[:-2]:
        chunk = json.loads(event.removeprefix("data: "))
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            st = out.setdefault(c["index"], {"token_ids": [], "finish_reason": None})
            st["token_ids"] += c.get("token_ids") or []
            assert st["finish_reason"] is None, "a choice finished twice"
            st["finish_reason"] = c["finish_reason"]
    return out


def check_job(job: Job) -> None:
    status = job.result["status"]
    if not job.admissible:
        assert status in (400, "cancelled", "gone"), (status, job)
        return
    if job.mode != "finish":
        assert status in (200, 499, "cancelled", "gone"), (status, job)
        return
    assert status == 200, (job.result, job)
    choices = choices_of(job, job.result["body"])
    assert sorted(choices) == list(range(job.n)), job
    for c in choices.values():
        num = len(c["token_ids"])
        assert c["finish_reason"] in ("stop", "length"), (c, job)
        assert num == job.body["max_tokens"] if c["finish_reason"] == "length" else 1 <= num, (c, job)
        assert num <= job.body["max_tokens"]


def test_random_mix_with_cancellations_leaves_nothing_behind(engine, caplog):
    rng = random.Random(1234)
    app = create_app(engine)
    jobs = [random_job(rng, engine) for _ in range(80)]

    async def main():
        await asyncio.gather(*(run_job(app, j) for j in jobs))

    asyncio.run(main())
    for job in jobs:
        check_job(job)
    assert {j.mode for j in jobs} == {"finish", "cancel", "disconnect"}
    assert {j.admissible for j in jobs} == {True, False}
    cut_off = [j for j in jobs if j.result["status"] in ("cancelled", 499, "gone")]
    assert cut_off, "no request was cut off mid-flight"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a client's doing logged an error"
    assert engine.client.core.scheduler.num_preemptions > 0, "the mix should have forced a preemption"
    assert_drained(engine)
    health = asyncio.run(_get(app, "/health"))
    assert (health["kv_cache"]["used_blocks"], health["running"], health["waiting"]) == (0, 0, 0), health
    fresh = Job("/v1/completions", {"prompt": "still alive", "max_tokens": 3, "ignore_eos": True,
                                    "return_token_ids": True, "stream": True}, 1, True, "finish")
    asyncio.run(run_job(app, fresh))
    check_job(fresh)
    assert_drained(engine)


def test_closing_engine_streams_early_frees_everything(engine):
    """i % 3 == 0: aclose() after the first output; 1: drop the iterator unclosed (the loop's async-generator
    finalizer closes it); 2: read to the end. The first two abort long before max_tokens."""
    aborted_before = _num_aborted(engine)

    async def read_some(i: int) -> None:
        params = SamplingParams(max_tokens=200, n=1 + i % 2, ignore_eos=True, seed=i)
        gen = engine.generate(f"close-{i}", list(range(3, 3 + 20 + i)), params)
        finished = False
        async for out in gen:
            finished = out.finished
            if i % 3 != 2:
                break
        assert finished == (i % 3 == 2)
        if i % 3 == 0:
            await gen.aclose()

    async def main():
        await asyncio.gather(*(read_some(i) for i in range(9)))
        for _ in range(1000):  # while this loop runs: it is the one that closes the dropped iterators
            if not engine._live:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"requests left running: {engine._live}")

    asyncio.run(main())
    assert _num_aborted(engine) - aborted_before == sum(1 + i % 2 for i in range(9) if i % 3 != 2)
    assert_drained(engine)


def _num_aborted(engine: AsyncEngine) -> float:
    return engine.metrics.value("pagewalk_request_success_total", {"finished_reason": "abort"})


# ---- aborts at each lifecycle stage, driven step by step on the engine core (no thread) ----------------

@pytest.fixture
def core():
    core, _ = build_core(EngineConfig(**CFG))  # no loop: the test steps the core
    yield core
    assert not core.requests and not core.scheduler.has_work()
    assert core.kv.usage().used_blocks == 0
    core.kv.check_integrity()


def add(core, rid: str, num_prompt: int, **params) -> Request:
    rng = random.Random(rid)
    prompt = [rng.randint(3, 258) for _ in range(num_prompt)]
    core.add_request(EngineRequest(rid, prompt, SamplingParams(ignore_eos=True, **params), 0.0))
    return core.requests[rid]


def step_until(core, cond, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if cond():
            return
        core.step()
        core.kv.check_integrity()
    raise AssertionError("condition never reached")


def abort(core, req: Request) -> None:
    updates = core.abort_request(req.request_id)
    assert updates and {u.finish_reason for u in updates} == {"abort"}
    assert req.request_id not in core.requests
    assert not any(core.kv.has_seq(s.seq_id) for s in req.seqs), "an aborted choice still holds blocks"
    core.kv.check_integrity()


def test_abort_while_waiting(core):
    abort(core, add(core, "w", 30, n=2))


def test_abort_during_chunked_prefill(core):
    req = add(core, "p", 200, n=3, max_tokens=4)
    core.step()
    parent = req.seqs[0]
    assert parent.status is SeqStatus.RUNNING and 0 < parent.num_computed_tokens < 200
    abort(core, req)


def test_abort_right_after_fork(core):
    req = add(core, "f", 40, n=4, max_tokens=8)
    core.step()
    assert all(s.status is SeqStatus.RUNNING for s in req.seqs)
    abort(core, req)


def test_abort_child_requeued_by_a_failed_fork(core):
    big = add(core, "big", 230, max_tokens=20)  # 15 blocks
    step_until(core, lambda: big.seqs[0].output_token_ids)
    req = add(core, "f", 231, n=3, max_tokens=20)  # 15 blocks, partial last: 1 block left for 2 children
    step_until(core, lambda: req.seqs[0].output_token_ids)
    requeued = [s for s in req.seqs[1:] if s.status is SeqStatus.WAITING]
    assert requeued and requeued[0] in core.scheduler.waiting
    abort(core, req)
    abort(core, big)


def test_abort_while_preempted(core):
    first = add(core, "a", 200, max_tokens=50)  # 2 x 16 blocks > 31 usable; 250 <= max_model_len
    second = add(core, "b", 200, max_tokens=50)
    step_until(core, lambda: second.seqs[0].num_preemptions > 0)
    assert second.seqs[0].status is SeqStatus.WAITING
    abort(core, second)
    step_until(core, lambda: first.request_id not in core.requests)
    assert first.seqs[0].finish_reason == "length" and len(first.seqs[0].output_token_ids) == 50


def test_abort_after_finish_is_a_no_op(core):
    req = add(core, "done", 10, n=2, max_tokens=3)
    step_until(core, lambda: req.request_id not in core.requests)
    assert core.abort_request(req.request_id) == []


def test_engine_abort_of_finished_and_unknown_ids_is_ignored(engine):
    async def main():
        async for _ in engine.generate("finished-1", [1, 5, 6], SamplingParams(max_tokens=2)):
            pass

    asyncio.run(main())
    engine.abort("finished-1")
    engine.abort("never-seen")
    assert_drained(engine)
    r = asyncio.run(_post(create_app(engine), {"prompt": "ok", "max_tokens": 2}))
    assert r.status_code == 200


async def _get(app, path: str) -> dict:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get(path, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


async def _post(app, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post("/v1/completions", json=body, timeout=60)
