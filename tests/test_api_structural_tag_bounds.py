"""A structural tag's structures, tags and triggers are bounded (MAX_TAGS, MAX_TRIGGERS: a 400 naming the
field past them), and each begin is matched against the triggers through an index (trigger_index.py), so
that parsing one, which parse_body runs on the API's event loop, holds the loop for milliseconds: trying
every trigger on every begin held it 8 s for a 300 KB body of 2,500 structures and 20,001 triggers, and 2 s
for a format within its node and text bounds (500 tags, 10,001 triggers), while no stream of any client
moved and /health did not answer."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server.api.app import create_app
from server.api.structural_format import MAX_TAGS, MAX_TRIGGERS
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=64) as engine:
        yield create_app(engine)


def held_loop(app, body: dict, path: str = "/v1/completions") -> tuple[float, float, int]:
    """-> (the longest the API's event loop was held while `body` was served at `path`, the request's time,
    status)"""
    gaps = []

    async def go():
        async def heartbeat():  # the event loop every stream's sends run on
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            start = time.perf_counter()
            r = await c.post(path, json=body, timeout=600)
            took = time.perf_counter() - start
        beat.cancel()
        return r, took

    r, took = asyncio.run(go())
    assert r.status_code < 500, r.text
    return max(gaps), took, r.status_code


def structures(n: int) -> list[dict]:
    return [{"begin": f"<f{i}>", "schema": {"type": "integer"}, "end": "</f>"} for i in range(n)]


def tags(n: int) -> list[dict]:
    return [{"begin": f"<f{i}>", "content": {"type": "const_string", "value": "1"}, "end": "</f>"}
            for i in range(n)]


def legacy(structures: list[dict], triggers: list[str]) -> dict:
    return {"response_format": {"type": "structural_tag", "structures": structures, "triggers": triggers}}


def triggered(tags: list[dict], triggers: list[str]) -> dict:
    return {"response_format": {"type": "structural_tag",
                                "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}}


def separated(tags: list[dict]) -> dict:
    return {"response_format": {"type": "structural_tag",
                                "format": {"type": "tags_with_separator", "separator": ",", "tags": tags}}}


def every_trigger(n: int) -> list[str]:
    return [f"<f{i}>" for i in range(n)]


@pytest.mark.parametrize("fields,param", [
    pytest.param(lambda n: legacy(structures(n), ["<f"]), "response_format.structures", id="structures"),
    pytest.param(lambda n: legacy(structures(1), every_trigger(n)), "response_format.triggers",
                 id="triggers"),
    pytest.param(lambda n: triggered(tags(n), ["<f"]), "response_format.format.tags",
                 id="triggered_tags.tags"),
    pytest.param(lambda n: triggered(tags(1), every_trigger(n)), "response_format.format.triggers",
                 id="triggered_tags.triggers"),
    pytest.param(lambda n: separated(tags(n)), "response_format.format.tags", id="tags_with_separator.tags"),
])
def test_a_structural_tag_is_served_up_to_its_bounds_and_refused_past_them(app, fields, param):
    bound = MAX_TRIGGERS if param.endswith("triggers") else MAX_TAGS
    r = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields(bound)})
    assert r.status_code == 200, r.text
    r = post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields(bound + 1)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and str(bound) in err["message"], err


def test_a_structural_tag_of_many_structures_and_triggers_does_not_hold_the_event_loop(app):
    many = [{"begin": "b", "schema": {}, "end": ""} for _ in range(2500)]
    held, took, status = held_loop(app, {"prompt": "hi", "max_tokens": 2,
                                         **legacy(many, [f"a{i}" for i in range(20000)] + ["b"])})
    assert held < 1.0, f"one request's parse held the API's event loop {held:.1f} s ({took:.1f} s, {status})"


def test_a_format_within_its_node_and_text_bounds_does_not_hold_the_event_loop(app):
    """500 tags x 10,001 triggers: 127 KB, 1,001 nodes."""
    empty = [{"begin": "b", "content": {"type": "const_string", "value": ""}, "end": ""} for _ in range(500)]
    held, took, status = held_loop(app, {"prompt": "hi", "max_tokens": 2,
                                         **triggered(empty, [f"a{i}" for i in range(10000)] + ["b"])})
    assert held < 1.0, f"one request's parse held the API's event loop {held:.1f} s ({took:.1f} s, {status})"

