"""Finding 3 of issue 17: a streaming request that cannot be queued gets its 429 (with Retry-After) or 503
as the HTTP status, exactly as a non-streaming one, never a 200 with an error event inside."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server.api.app import create_app
from server.api.async_engine import RequestRejected
from server.engine.sampling_params import SamplingParams
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(model="tiny", device="cpu", attention_backend="torch", num_blocks=64, max_num_seqs=1,
           max_waiting=2)


def test_a_burst_over_the_queue_is_refused_before_the_status_line():
    with started_engine(**CFG) as engine:
        app = create_app(engine)
        prompt = engine.tokenizer.encode("hold the only row")
        hold = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

        async def go():
            holder = engine.generate("holder", prompt, hold)
            await anext(holder)  # it runs: the one row is taken, the queue is empty
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
                burst = [c.post("/v1/completions", json={**body, "stream": i % 2 == 0}, timeout=60)
                         for i in range(6)]
                responses = await asyncio.gather(*burst)
            await holder.aclose()
            return responses

        responses = asyncio.run(go())
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 429, 429, 429, 429], [(r.status_code, r.text[:200]) for r in responses]
    for r in responses:
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
            assert "max_waiting=2)" in r.json()["error"]["message"]  # one API server: the setting itself
        else:
            assert "error" not in r.text, r.text  # the two admitted ones were served, not refused inside


def test_streaming_while_shutting_down_is_503():
    with started_engine(**CFG) as engine:
        app = create_app(engine)
        engine.shutdown(timeout=5)

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await c.post("/v1/completions", json={"prompt": "hi", "stream": True}, timeout=30)

        r = asyncio.run(go())
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error", r.text


def test_an_admitted_prompt_is_not_refused_by_a_queue_that_refilled(monkeypatch):
    """Preemptions move running requests back to waiting after an admitted request's status line: its
    later prompts (or a stream whose generator starts after the 200) hold reserved places and still run."""
    with started_engine(**CFG) as engine:
        monkeypatch.setattr(engine, "_num_waiting", lambda: engine.max_waiting + 3)  # the refilled queue
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        prompt = engine.tokenizer.encode("admitted")
        with pytest.raises(RequestRejected) as refused:
            engine.check_admissible(len(prompt), params)
        assert refused.value.status == 429
        engine.check_admissible(len(prompt), params, admitted=True)

        async def go():
            return [out async for out in engine.generate("admitted", prompt, params, admitted=True)]

        outs = asyncio.run(go())
        assert outs[-1].finished and sum(len(o.deltas[0].token_ids) for o in outs) == 2


def test_a_drain_that_starts_during_admission_waits_for_the_admitted_request(monkeypatch):
    """SIGTERM's drain begins while a request's admission checks run: the checks and the reservation are
    one step under the lock the drain reads reservations under, so the drain waits for that request (before,
    it could see no reservation, end, and refuse the admitted request's prompt inside its 200)."""
    import threading

    from server.api.admission import AdmissionGate

    with started_engine(**CFG) as engine:
        real = engine.check_admissible
        drain = threading.Thread(target=engine.shutdown, kwargs={"timeout": 5})

        def racing(*args, **kw):
            if not drain.is_alive():
                drain.start()
                deadline = time.monotonic() + 0.3  # the drain's first step: stop accepting (it waits here)
                while engine._accepting and time.monotonic() < deadline:
                    time.sleep(0.01)
            return real(*args, **kw)

        monkeypatch.setattr(engine, "check_admissible", racing)
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        reservation = AdmissionGate(engine).reserve([engine.tokenizer.encode("admitted")], params)
        time.sleep(0.3)
        assert engine._serving_admitted, "the drain ended without waiting for the admitted request"
        reservation.release()
        drain.join(timeout=10)
        assert not drain.is_alive()
