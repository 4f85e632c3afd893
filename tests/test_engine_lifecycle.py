"""Engine lifecycle on the real tiny model: preemption, abort, admission refusal, failures, shutdown."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import pytest
from engine_helpers import collect, make_engine, run_all, run_one, wait_until

from kvcache.snapshot import per_block
from server.api.async_engine import RequestRejected
from server.api.choice_stream import ChoiceStream
from server.engine.outputs import EngineRequest
from server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine():
    e = make_engine(max_waiting=64)
    yield e
    e.shutdown(timeout=5)


def test_tiny_cache_preempts_and_every_request_completes_exactly():
    e = make_engine(num_blocks=24, max_num_batched_tokens=64)  # 23 usable blocks = 368 tokens
    try:
        prompts = [e.tokenizer.encode(f"request number {i}: " + "xyz" * (3 + i)) for i in range(6)]
        lengths = [48 + 4 * i for i in range(6)]
        jobs = list(enumerate(zip(prompts, lengths, strict=True)))
        solo = [run_one(e, f"solo-{i}", p, greedy(n)) for i, (p, n) in jobs]
        crowd = run_all(e, [(f"crowd-{i}", p, greedy(n)) for i, (p, n) in jobs])
        assert e.metrics.value("pagewalk_num_preemptions_total") > 0
        for s, c, n in zip(solo, crowd, lengths, strict=True):
            assert len(c.choices[0].token_ids) == n and c.choices[0].finish_reason == "length"
            assert c.choices[0].token_ids == s.choices[0].token_ids
            assert c.choices[0].text == s.choices[0].text
        assert wait_until(lambda: e.health()["kv_cache"]["used_blocks"] == 0)
        e.client.core.kv.check_integrity()
    finally:
        e.shutdown(timeout=5)


def test_closing_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        agen = engine.generate("abort-close", engine.tokenizer.encode("abort me"), greedy(500))
        n = 0
        async for out in agen:
            n += len(out.deltas[0].token_ids)
            if n >= 3:
                break
        assert engine.health()["kv_cache"]["used_blocks"] > 0
        await agen.aclose()
        # the abort's finish reaches the metrics on this loop: it stays open until then (a loop closed
        # before it runs a callback drops it; the server's loop lives as long as the process)
        for _ in range(500):
            if aborts() == before + 1:
                break
            await asyncio.sleep(0.01)

    def aborts() -> float:
        return engine.metrics.value("pagewalk_request_success_total", {"finished_reason": "abort"})

    before = aborts()
    asyncio.run(main())
    assert wait_until(lambda: engine.health()["kv_cache"]["used_blocks"] == 0)
    assert wait_until(lambda: engine.health()["running"] == 0)
    assert aborts() == before + 1


def test_explicit_abort_ends_the_stream_with_abort(engine):
    async def main():
        outs = []
        async for out in engine.generate("abort-explicit", engine.tokenizer.encode("stop it"), greedy(500)):
            outs.append(out)
            if len(outs) == 2:
                engine.abort("abort-explicit")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].deltas[-1].finish_reason == "abort"
    assert sum(len(o.deltas[0].token_ids) for o in outs) < 500
    assert wait_until(lambda: engine.health()["kv_cache"]["used_blocks"] == 0)


def test_cancelled_task_aborts(engine):
    async def main():
        prompt = engine.tokenizer.encode("cancel")
        task = asyncio.create_task(collect(engine, "abort-cancel", prompt, greedy(500)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert wait_until(lambda: engine.health()["kv_cache"]["used_blocks"] == 0)


def test_admission_refusals_name_both_numbers(engine):
    with pytest.raises(RequestRejected) as too_long:
        engine.check_admissible(2000, SamplingParams(max_tokens=100))
    assert too_long.value.status == 400 and "2100" in too_long.value.message
    assert str(engine.max_model_len) in too_long.value.message and too_long.value.param == "max_tokens"
    cap = engine.capacity_tokens  # 255 blocks x 16 = 4080 tokens
    with pytest.raises(RequestRejected) as too_big:
        engine.check_admissible(100, SamplingParams(max_tokens=1000, n=5))
    assert too_big.value.status == 400
    # (100 + 1000 - 1) KV positions x 5: a choice's last token takes none
    assert "5495" in too_big.value.message and str(cap) in too_big.value.message
    engine.check_admissible(100, SamplingParams(max_tokens=1000, n=3))  # 3300 fits
    with pytest.raises(RequestRejected) as empty:
        engine.check_admissible(0, SamplingParams())
    assert empty.value.status == 400
    with pytest.raises(RequestRejected) as too_many:
        engine.check_admissible(5, SamplingParams(n=17))  # max_num_seqs=16: could never be scheduled
    assert too_many.value.status == 400 and too_many.value.param == "n"


def test_shutdown_refuses_new_requests_with_503():
    e = make_engine()
    e.check_admissible(5, SamplingParams())
    e.shutdown(timeout=0)
    with pytest.raises(RequestRejected) as stopping:
        e.check_admissible(5, SamplingParams())
    assert stopping.value.status == 503


def test_waiting_queue_limit():
    e = make_engine(max_waiting=2, max_num_seqs=1)
    try:
        async def main():
            tasks = [asyncio.create_task(collect(e, "q-0", [1, 5, 6], greedy(1500)))]
            while e.health()["running"] < 1:
                await asyncio.sleep(0.01)
            tasks += [asyncio.create_task(collect(e, f"q-{i}", [1, 5, 6], greedy(1500))) for i in (1, 2)]
            await asyncio.sleep(0.05)  # q-0 runs, q-1 and q-2 wait (max_num_seqs=1)
            assert (e.health()["running"], e.health()["waiting"]) == (1, 2)
            with pytest.raises(RequestRejected) as full:
                e.check_admissible(3, SamplingParams())
            assert full.value.status == 429 and "2" in full.value.message
            with pytest.raises(RequestRejected):
                await collect(e, "q-extra", [1, 5], greedy(2))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(main())
    finally:
        e.shutdown(timeout=5)


def test_prompt_tokens_count_prompts_whose_prefill_ran():
    """pagewalk_prompt_tokens_total is vLLM's prompt_tokens_total ("prefill tokens processed"): a request
    that waited and was aborted before it ran adds nothing; one that ran adds its prompt at its first
    token."""
    e = make_engine(max_num_seqs=1)
    count = lambda: e.metrics.value("pagewalk_prompt_tokens_total")  # noqa: E731
    try:
        async def main():
            holder = asyncio.create_task(collect(e, "holder", [1, 5, 6], greedy(1500)))
            while e.health()["running"] < 1:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # its first token is out
            assert count() == 3
            queued = asyncio.create_task(collect(e, "queued", [1] + [7] * 99, greedy(4)))
            while e.health()["waiting"] < 1:
                await asyncio.sleep(0.01)
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            while e.health()["waiting"]:
                await asyncio.sleep(0.01)
            assert count() == 3
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)
            await collect(e, "ran", [1] + [8] * 9, greedy(2))
            assert count() == 13

        asyncio.run(main())
    finally:
        e.shutdown(timeout=5)


def test_invalid_params_are_refused_by_generate(engine):
    with pytest.raises(RequestRejected) as bad:
        run_one(engine, "bad-params", [1, 2], SamplingParams(top_p=1.5))
    assert bad.value.status == 400 and "top_p must be in (0, 1], got 1.5" in bad.value.message


def test_duplicate_request_id_is_refused(engine):
    async def main():
        first = asyncio.create_task(collect(engine, "dup", [1, 7, 8], greedy(300)))
        await asyncio.sleep(0.1)
        with pytest.raises(RequestRejected) as dup:
            await collect(engine, "dup", [1, 7, 8], greedy(2))
        assert dup.value.status == 400
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)

    asyncio.run(main())


def test_failure_in_one_request_fails_only_that_one(engine, monkeypatch):
    apply = ChoiceStream.apply

    def exploding(self, u):
        if u.request_id == "bad":
            raise RuntimeError("detokenizer exploded")
        return apply(self, u)

    monkeypatch.setattr(ChoiceStream, "apply", exploding)
    bad, good = run_all(engine, [("bad", [1, 10, 11], greedy(8)), ("good", [1, 12, 13], greedy(8))])
    assert bad.choices[0].finish_reason == "error" and "detokenizer exploded" in bad.error
    assert good.error is None and len(good.choices[0].token_ids) == 8
    assert wait_until(lambda: engine.health()["kv_cache"]["used_blocks"] == 0)


def test_failed_step_fails_its_batch_and_the_engine_keeps_serving(engine, monkeypatch):
    execute = engine.client.core.runner.execute
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device on fire")
        return execute(*args)

    monkeypatch.setattr(engine.client.core.runner, "execute", flaky)
    results = run_all(engine, [(f"flaky-{i}", [1, 20 + i, 30], greedy(10)) for i in range(3)])
    failed = [r for r in results if r.error]
    assert failed
    assert all("device on fire" in r.error and r.choices[0].finish_reason == "error" for r in failed)
    after = run_one(engine, "after-fire", [1, 2, 3], greedy(5))
    assert after.error is None and len(after.choices[0].token_ids) == 5
    assert wait_until(lambda: engine.health()["kv_cache"]["used_blocks"] == 0)


def test_shutdown_lets_short_requests_finish_and_aborts_long_ones():
    e = make_engine()

    async def main():
        short = asyncio.create_task(collect(e, "short", [1, 40, 41], greedy(3)))
        long = asyncio.create_task(collect(e, "long", [1, 42, 43], greedy(1500)))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(e.shutdown, 0.5)
        return await short, await long

    short, long = asyncio.run(main())
    assert short.choices[0].finish_reason == "length" and len(short.choices[0].token_ids) == 3
    assert long.choices[0].finish_reason == "abort" and len(long.choices[0].token_ids) < 1500
    assert e.health()["status"] != "ok" and not e.client.is_alive()
    assert e.health()["kv_cache"]["used_blocks"] == 0


def test_kv_snapshot_names_each_block_holder(engine):
    async def main():
        agen = engine.generate("snap", engine.tokenizer.encode("x" * 40), greedy(200))
        async for _ in agen:
            snap = await engine.kv_snapshot()
            break
        await agen.aclose()
        return snap

    snap = asyncio.run(main())
    used = [b for b in per_block(snap) if b["state"] == "used"]
    assert len(used) == snap["used_blocks"] >= 3  # 41 prompt tokens + 1 in blocks of 16
    assert all(o["request_id"] == "snap" and o["index"] == 0 for b in used for o in b["owners"])


@pytest.mark.parametrize("ids, bad", [([5, -1, 7], "-1"), ([5, 10**6], "1000000"), ([5, 2.0], "2.0"),
                                      ([5, "7"], "'7'")])
def test_core_refuses_prompt_ids_outside_the_vocabulary(ids, bad):
    import time

    import numpy as np

    from server.engine.engine import EngineConfig, build_core
    from server.engine.outputs import EngineRequest
    core, _ = build_core(EngineConfig(model="tiny", device="cpu", attention_backend="torch", num_blocks=16))
    vocab = core.runner.config.vocab_size
    with pytest.raises(ValueError, match=rf"integers in \[0, {vocab}\), got {bad}"):
        core.add_request(EngineRequest("bad", ids, greedy(2), time.monotonic()))
    core.add_request(EngineRequest("ok", [5, np.int64(7), vocab - 1], greedy(2), time.monotonic()))
    assert "ok" in core.requests and "bad" not in core.requests


def drain_a_windowed_request(stream: bool, window: int, max_tokens: int, drain_s: float):
    """A request of 6 prompts, `window` of them in the engine at once, and a drain of `drain_s` s that
    starts while its first window runs (a new request is sent 0.05 s into it): the request is a 200 with
    every choice finished -> (its finished choices, the new request's response)."""
    import threading

    import httpx

    from server.api.admission import RequestLimits
    from server.api.app import create_app

    e = make_engine(max_num_seqs=4)
    app = create_app(e, limits=RequestLimits(max_seqs_per_request=window))
    body = {"prompt": [f"prompt {i}" for i in range(6)], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": stream}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            big = asyncio.create_task(c.post("/v1/completions", json=body, timeout=60))
            assert await asyncio.to_thread(wait_until, lambda: e.health()["running"] > 0)
            drain = threading.Thread(target=e.shutdown, args=(drain_s,))
            drain.start()
            await asyncio.sleep(0.05)
            late = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=60)
            r = await big
            await asyncio.to_thread(drain.join)
            return r, late

    r, late = asyncio.run(main())
    assert r.status_code == 200, r.text
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in ev for ev in events), r.text[-500:]
        finished = [c for ev in events[:-1] for c in json.loads(ev)["choices"] if c["finish_reason"]]
    else:
        finished = r.json()["choices"]
    assert sorted(c["index"] for c in finished) == list(range(6))
    assert e.reserved == 0 and not e.client.is_alive()
    return finished, late


@pytest.mark.parametrize("stream", [False, True])
def test_drain_finishes_every_prompt_of_an_admitted_windowed_request(stream):
    """A request of 6 prompts with a window of 2 in the engine at once is admitted whole; a drain that
    starts while its first window runs serves its later prompts too (they used to get 503 "shutting down",
    and the drain ended as soon as the first window did), while a new request gets its 503."""
    finished, late = drain_a_windowed_request(stream, window=2, max_tokens=12, drain_s=20.0)
    assert late.status_code == 503
    assert all(c["finish_reason"] == "length" for c in finished)


@pytest.mark.parametrize("stream", [False, True])
def test_a_windowed_request_at_the_drains_deadline_ends_abort(stream):
    """The same request, one prompt in the engine at a time, long outputs, a drain of 0.5 s: the running
    prompt ends "abort" at the deadline and the prompts still waiting for their window end "abort" too,
    a 200 with every choice (their 503 "shutting down" failed the whole request, the choices already
    generated with it, unary and streamed: a review)."""
    finished, late = drain_a_windowed_request(stream, window=1, max_tokens=600, drain_s=0.5)
    assert late.status_code == 503
    assert {c["finish_reason"] for c in finished} == {"abort"}


def test_a_detokenizer_failure_ends_every_choice_once_after_their_pending_deltas(engine, monkeypatch):
    """n = 2, choice 1's third update fails to detokenize in the same call as a delta of choice 0: the
    failure's final output carries choice 0's delta first, then both choices' "error" finishes (the
    delta used to be merged after them, erasing choice 0's finish)."""
    real = ChoiceStream.apply
    calls = {}

    def failing(self, u):
        calls[self.index] = calls.get(self.index, 0) + 1
        if self.index == 1 and calls[1] == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, u)

    monkeypatch.setattr(ChoiceStream, "apply", failing)
    outs = asyncio.run(collect_outputs(engine, "detok-fail", [1, 2, 3], greedy(10, n=2)))
    finishes = [(d.index, d.finish_reason) for o in outs for d in o.deltas if d.finish_reason]
    assert sorted(finishes) == [(0, "error"), (1, "error")]
    last_of = {d.index: d for d in outs[-1].deltas}
    assert outs[-1].finished and last_of[0].finish_reason == "error" and last_of[1].finish_reason == "error"
    assert wait_until(lambda: engine.health()["kv_cache"]["used_blocks"] == 0)


async def collect_outputs(engine, request_id, prompt, params):
    return [out async for out in engine.generate(request_id, prompt, params)]


def test_a_query_racing_the_cores_death_is_a_503_not_a_hang():
    """The core dies between /debug's liveness check and its call's registration: the check and the
    registration are one step under the lock, so the query is refused instead of waiting forever."""
    e = make_engine()
    try:
        async def main():
            loop = asyncio.get_running_loop()
            real = loop.create_future

            def dying_future():
                if sys._getframe(1).f_code.co_name == "_query":  # the query's own future, not wait_for's
                    loop.create_future = real
                    e._on_death("injected")  # what the client thread runs when the core's process ends
                return real()

            loop.create_future = dying_future
            with pytest.raises(RequestRejected) as refused:
                await asyncio.wait_for(e.kv_snapshot(), timeout=5)
            assert refused.value.status == 503

        asyncio.run(main())
    finally:
        e.shutdown(timeout=5)


def test_the_drains_abort_never_overtakes_the_add_it_aborts():
    # a request registered just before shutdown copies the live requests: its add is on its way while the
    # drain sends its Abort. The core ignores an Abort of an id it does not hold; if the add arrived second,
    # the request would run on and the drain would take the working core for a hung one (and kill it)
    e = make_engine()
    core, send = e.client.core, e.client.send
    step = core.step

    def slow_step():  # a real model's step time, so the request is still running at the abort
        time.sleep(0.01)
        return step()

    registered = threading.Event()

    def send_late(msg):
        if isinstance(msg, EngineRequest):  # generate has registered the request; the drain starts meanwhile
            registered.set()
            time.sleep(0.5)
        send(msg)

    core.step, e.client.send = slow_step, send_late
    drained = threading.Thread(target=lambda: registered.wait(10) and e.shutdown(timeout=0.05))
    drained.start()

    async def main():
        params = greedy(1500)
        return [out async for out in e.generate("late", [1, 2, 3], params, admitted=True)]

    outs = asyncio.run(main())
    drained.join(30)
    assert e.dead is None, e.dead
    assert [d.finish_reason for o in outs for d in o.deltas if d.finish_reason] == ["abort"]


def test_prefix_cache_counters_count_each_prompts_first_lookup_only():
    # under preemption a sequence's recompute looks up its prompt + generated tokens again and finds its
    # own old blocks; counted, 6 prompts sharing nothing read 17% hits (vLLM counts first lookups only)
    e = make_engine(block_size=4, max_num_seqs=6, max_num_batched_tokens=48, num_blocks=24)
    try:
        prompts = [[3 + (7 * i + 13 * j) % 240 for j in range(5 + 3 * i)] for i in range(6)]
        run_all(e, [(f"r{i}", p, greedy(30)) for i, p in enumerate(prompts)])
        m = e.metrics
        assert wait_until(lambda: m.value("pagewalk_prefix_cache_queries_total") > 0)
        assert m.value("pagewalk_num_preemptions_total") > 0  # the case under test
        assert m.value("pagewalk_prefix_cache_queries_total") == sum(len(p) for p in prompts)
        assert m.value("pagewalk_prefix_cache_hits_total") == 0
    finally:
        e.shutdown(timeout=5)


def test_step_metrics_count_every_step_once_with_its_tokens():
    # 3 prompts of 20 + 7 + 30 tokens through a 16-token budget, then 5 / 9 / 2 greedy tokens each (the
    # first from the prompt's last chunk, the rest one decode token a step; CPU: no async overlap, so no
    # step computes a token past the end)
    budget = 16
    e = make_engine(max_num_batched_tokens=budget)
    try:
        prompts = [[3 + (5 * i + 11 * j) % 200 for j in range(n)] for i, n in enumerate((20, 7, 30))]
        outputs = (5, 9, 2)
        run_all(e, [(f"s{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))])
        m = e.metrics
        tokens = sum(map(len, prompts)) + sum(n - 1 for n in outputs)
        assert wait_until(lambda: m.value("pagewalk_iteration_tokens_total_sum") == tokens)
        prompt_steps = m.value("pagewalk_engine_steps_total", {"kind": "prompt"})
        decode_steps = m.value("pagewalk_engine_steps_total", {"kind": "decode"})
        assert m.value("pagewalk_iteration_tokens_total_count") == prompt_steps + decode_steps
        assert prompt_steps >= -(-sum(map(len, prompts)) // budget)  # no step holds more than the budget
        assert decode_steps >= max(outputs) - 1 - prompt_steps
        assert m.value("pagewalk_iteration_tokens_total_bucket", {"le": str(float(budget))}) == (
            prompt_steps + decode_steps)
        assert m.value("pagewalk_iteration_tokens_total_bucket", {"le": "8.0"}) >= decode_steps  # <= 3 rows
    finally:
        e.shutdown(timeout=5)
