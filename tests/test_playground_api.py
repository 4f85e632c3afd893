"""The playground's HTTP side on a fake engine: the page and its files, /debug/kvcache and its auth, and the
snapshot stream (asks the engine only while connected, sends a map only when it changed)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from server.api import debug
from server.api.app import create_app
from server.api.playground import ASSETS
from server.engine.outputs import CoreStats

pytestmark = pytest.mark.timeout(60)

MAP = {"block_size": 16, "num_blocks": 8, "free_blocks": 6, "used_blocks": 1, "cached_blocks": 1,
       "seqs": [{"seq_id": 0, "request_id": "cmpl-1", "index": 0, "num_tokens": 3, "blocks": [[1, 1]]}],
       "cached": [[2, 1]]}


class FakeEngine:
    """What the debug routes use of an engine: kv_snapshot, health, the core's last stats."""

    def __init__(self, with_snapshot: bool = True):
        self.calls = 0
        if not with_snapshot:
            self.kv_snapshot = None

    def last_core_stats(self) -> CoreStats:
        return CoreStats(1, 2, 10, 3, 1, 0.0, generated_tokens=5, preemptions=1, prefill_tokens=7)

    async def kv_snapshot(self) -> dict:
        self.calls += 1
        return dict(MAP)

    def health(self) -> dict:
        return {"status": "ok", "running": 1, "waiting": 2}


def get(app, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(path, timeout=30, **kw)
    return asyncio.run(go())


def test_page_and_its_files_are_served_without_a_key():
    app = create_app(FakeEngine(), api_key="s3cret")
    r = get(app, "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for name, media in ASSETS.items():
        assert f"/playground/{name}" in r.text or name == "kvmap.js"  # kvmap.js is imported by app.js
        f = get(app, f"/playground/{name}")
        assert f.status_code == 200 and f.headers["content-type"].startswith(media) and f.text
    assert "./kvmap.js" in get(app, "/playground/app.js").text
    assert get(app, "/playground/secrets.txt").status_code == 404
    assert get(app, "/playground/..%2Fdebug.py").status_code == 404


def test_page_and_its_files_run_only_their_own_code_and_are_never_framed():
    """The page holds the API key: a CSP allows its own scripts, styles and server alone, no other site may
    frame it, and no file is sniffed as another type (a review found no header at all). The browser tests
    load the page under it with no console error."""
    app = create_app(FakeEngine())
    for path in ["/", *(f"/playground/{name}" for name in ASSETS)]:
        h = get(app, path).headers
        csp = dict(part.strip().split(" ", 1) for part in h["content-security-policy"].split(";"))
        assert csp["default-src"] == "'none'" and csp["script-src"] == "'self'"
        assert csp["connect-src"] == "'self'"
        assert csp["frame-ancestors"] == "'none'" and h["x-frame-options"] == "DENY", path
        assert h["x-content-type-options"] == "nosniff", path


def test_page_fetches_nothing_from_outside():
    app = create_app(FakeEngine())
    for path in ["/", *(f"/playground/{name}" for name in ASSETS)]:
        text = get(app, path).text
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, path


def test_snapshot_json_with_queues_and_totals():
    engine = FakeEngine()
    r = get(create_app(engine), "/debug/kvcache")
    assert r.status_code == 200
    assert r.json() == {**MAP, "running": 1, "waiting": 2,
                        "totals": {"prefill_tokens": 7, "generated_tokens": 5, "preemptions": 1}}
    assert engine.calls == 1


@pytest.mark.parametrize("path", ["/debug/kvcache", "/debug/kvcache/stream"])
def test_debug_routes_require_the_api_key(path):
    engine = FakeEngine()
    app = create_app(engine, api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = get(app, path, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert engine.calls == 0
    if path == "/debug/kvcache":
        assert get(app, path, headers={"Authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.parametrize("path", ["/debug/kvcache", "/debug/kvcache/stream"])
def test_debug_routes_turned_off_are_a_404_that_says_how_to_turn_them_on(path):
    """A map names every client's requests and which share prefixes across cache salts (a review): a server
    on other interfaces serves none by default (server.cli.debug_endpoints)."""
    engine = FakeEngine()
    r = get(create_app(engine, debug_endpoints=False), path)
    assert r.status_code == 404 and r.json()["error"]["code"] == "debug_endpoints_off"
    assert "--debug-endpoints" in r.json()["error"]["message"] and engine.calls == 0


def test_engine_without_a_block_map_answers_503():
    r = get(create_app(FakeEngine(with_snapshot=False)), "/debug/kvcache/stream")
    assert r.status_code == 503 and r.json()["error"]["code"] == "kv_snapshot_unavailable"


def test_stream_sends_changed_maps_only_and_stops_asking_when_the_client_leaves():
    maps = [{"v": 1}, {"v": 1}, {"v": 2}, {"v": 2}, {"v": 2}, {"v": 3}]
    asked = 0
    connected_polls = 6

    async def take() -> dict:
        nonlocal asked
        asked += 1
        return maps[asked - 1]

    async def is_disconnected() -> bool:
        return asked >= connected_polls

    async def go() -> list[str]:
        return [e async for e in debug.snapshot_events(take, is_disconnected, interval_s=0)]

    events = asyncio.run(go())
    assert events == ['data: {"v":1}\n\n', 'data: {"v":2}\n\n', 'data: {"v":3}\n\n']
    assert asked == connected_polls  # not one poll after the disconnect


def test_stream_spaces_out_maps_that_are_slow_to_build():
    cost_s, polls = 0.02, 3
    asked = 0

    async def take() -> dict:
        nonlocal asked
        asked += 1
        await asyncio.sleep(cost_s)
        return {"v": asked}

    async def is_disconnected() -> bool:
        return asked >= polls

    async def go() -> float:
        start = time.monotonic()
        assert len([e async for e in debug.snapshot_events(take, is_disconnected, interval_s=0)]) == polls
        return time.monotonic() - start

    elapsed = asyncio.run(go())
    # each map is followed by a wait of at least 9x its cost: the engine spends <= 10% of its time on maps
    assert elapsed >= polls * cost_s / debug.MAX_WATCH_SHARE * 0.95


def test_stream_ends_with_an_error_body_when_the_engine_stops_answering():
    asked = 0

    async def take() -> dict:
        nonlocal asked
        asked += 1
        if asked == 2:
            raise debug.APIError(503, "the engine core is not running")
        return {"v": 1}

    async def never() -> bool:
        return False

    async def go() -> list[str]:
        return [e async for e in debug.snapshot_events(take, never, interval_s=0)]

    events = asyncio.run(go())
    assert events[0] == 'data: {"v":1}\n\n' and len(events) == 2
    assert json.loads(events[1].removeprefix("data: "))["error"]["type"] == "service_unavailable_error"


def test_watchers_share_the_engines_maps():
    """Each stream asked the engine for its own map: 32 watchers cost it 32 times what one does (a review).
    The maps are shared: one request in flight, each map reused until it is due again."""
    engine = FakeEngine()
    shared = debug.SharedMap(engine, interval_s=0.05)

    async def watch(seconds: float) -> int:
        end = time.monotonic() + seconds

        async def gone() -> bool:
            return time.monotonic() >= end

        return len([e async for e in debug.snapshot_events(shared.take, gone, interval_s=0.05)])

    async def go(watchers: int) -> list[int]:
        return await asyncio.gather(*(watch(0.5) for _ in range(watchers)))

    events = asyncio.run(go(32))
    assert all(n == 1 for n in events)  # the map never changed: each watcher got it once
    assert engine.calls <= 0.5 / 0.05 + 2, engine.calls  # one engine map per interval, not per watcher
