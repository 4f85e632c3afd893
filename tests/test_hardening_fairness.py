"""Finding 8 of issue 17: one request of many prompts cannot starve small requests. Its prompts enter the
engine a window at a time (--max-seqs-per-request), so small requests queue behind that window, not behind
every prompt of it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server.api.admission import RequestLimits
from server.api.app import create_app
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(model="tiny", device="cpu", attention_backend="torch", num_blocks=128, max_num_seqs=8)
BODY = {"temperature": 0, "ignore_eos": True}


def run(limits: RequestLimits) -> tuple[float, list[float]]:
    with started_engine(**CFG) as engine:
        app = create_app(engine, limits=limits)

        async def timed(c: httpx.AsyncClient, body: dict) -> float:
            start = time.perf_counter()
            r = await c.post("/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return time.perf_counter() - start

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                big = asyncio.create_task(timed(c, {"prompt": [[5, 6, 7]] * 64, "max_tokens": 24, **BODY}))
                await asyncio.sleep(0.05)  # the big request is queued first
                small = await asyncio.gather(*(timed(c, {"prompt": f"small {i}", "max_tokens": 8, **BODY})
                                               for i in range(6)))
                return await big, small

        return asyncio.run(go())


def test_small_requests_are_not_starved_by_a_request_of_many_prompts():
    big, small = run(RequestLimits())  # window: max_num_seqs / 2 = 4 choices of the big request at once
    assert max(small) < 0.5 * big, (big, small)
