"""/metrics against what happened to the requests (a review): every request counted finished is observed
in the per-request histograms, and a request's prompts held behind its window are waiting, their wait part
of their latencies."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.api.admission import RequestLimits
from server.api.app import create_app
from server.api.choice_stream import ChoiceStream
from server.engine.sampling_params import SamplingParams
from tests.engine_helpers import run_one, started_engine

pytestmark = pytest.mark.timeout(300)
CFG = dict(model="tiny", device="cpu", attention_backend="torch", num_blocks=256, max_num_seqs=4)


def samples(engine) -> dict[tuple[str, tuple], float]:
    """(series name, labels but model_name) -> value, from the engine's exposition."""
    out = {}
    for family in text_string_to_metric_families(engine.metrics.exposition().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def grown(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_a_request_failed_in_the_api_process_is_observed_as_finished(monkeypatch):
    """Its detokenizer raising on the 4th token fails it there: counted in request_success_total{error},
    it was missing from the e2e latency and token histograms (a request the core fails was not)."""
    apply, calls = ChoiceStream.apply, {"n": 0}

    def failing(self, update):
        calls["n"] += 1
        if calls["n"] == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return apply(self, update)

    monkeypatch.setattr(ChoiceStream, "apply", failing)
    with started_engine(**CFG) as engine:
        before = samples(engine)
        res = run_one(engine, "r", engine.tokenizer.encode("fail me later"),
                      SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        after = samples(engine)
    assert res.error and res.choices[0].finish_reason == "error"
    assert grown(before, after, "pagewalk_request_success_total", finished_reason="error") == 1
    for name in ("pagewalk_e2e_request_latency_seconds_count", "pagewalk_request_generation_tokens_count",
                 "pagewalk_request_prompt_tokens_count"):
        assert grown(before, after, name) == 1, name


def test_prompts_held_behind_their_window_are_waiting_and_their_wait_is_latency():
    """Three prompts of one request, one in the engine at a time: while the first runs the other two
    wait (they were not counted), and each prompt's e2e latency counts from the request's arrival (it
    counted from its entry into the window: the sum was ~the request's time, now ~2x)."""
    body = {"prompt": ["alpha one", "beta two", "gamma three"], "max_tokens": 60, "temperature": 0,
            "ignore_eos": True}
    with started_engine(**CFG) as engine:
        app = create_app(engine, limits=RequestLimits(max_seqs_per_request=1))
        health: list[dict] = []

        async def post() -> float:
            async def poll():
                while True:
                    health.append(engine.health())
                    await asyncio.sleep(0.01)

            poller = asyncio.create_task(poll())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                start = time.monotonic()
                r = await c.post("/v1/completions", json=body, timeout=120)
                wall = time.monotonic() - start
            poller.cancel()
            assert r.status_code == 200, r.text
            return wall

        before = samples(engine)
        wall = asyncio.run(post())
        after = samples(engine)
    assert max(h["waiting"] for h in health if h["running"] >= 1) == 2
    assert grown(before, after, "pagewalk_e2e_request_latency_seconds_count") == 3
    assert grown(before, after, "pagewalk_e2e_request_latency_seconds_sum") >= 1.5 * wall
