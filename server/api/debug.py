"""GET /debug/kvcache (the engine's KV block map as JSON) and GET /debug/kvcache/stream (SSE of it).

The block map comes from the engine (``await engine.kv_snapshot()``: see kvcache/snapshot.py for its
shape); this layer adds the running / waiting counts of ``engine.health()`` where the map lacks them, and
the engine's running totals of prefill tokens, generated tokens and preemptions, so a viewer shows what
ran between two maps.
The engine builds a map only when asked: the stream asks a few times a second while a client is connected
and sends a map only when it changed, so nobody watching costs the engine nothing.

Both require the API key when the server has one (``Authorization: Bearer <key>``, as /v1/*), and answer
only where the server turns them on (``--debug-endpoints``; by default a server on loopback only): a map
names every client's requests and shows which of them share prefixes, across cache salts (a review).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers

from server.api.admission import rejected_to_api_error
from server.api.async_engine import RequestRejected
from server.api.auth import bearer_token, token_matches
from server.api.errors import APIError, error_body

POLL_INTERVAL_S = 0.25  # the page redraws at this rate; a step of the tiny model is far shorter
# A map of a GPU cache (hundreds of thousands of blocks) takes the core a while to build: the stream waits
# long enough between maps that watching takes at most this share of the engine's time.
MAX_WATCH_SHARE = 0.1


def require_debug_access(request: Request) -> None:
    """A 404 where the server does not serve the debug endpoints; a 401 without the API key it has."""
    if not getattr(request.app.state, "debug_endpoints", True):
        raise APIError(404, "The KV block map is off on this server (it names every client's requests); "
                            "start it with --debug-endpoints to serve it.", code="debug_endpoints_off")
    api_key = getattr(request.app.state, "api_key", None)
    if not api_key:
        return
    token = bearer_token(Headers(scope=request.scope).get("authorization"))
    if not token_matches(token, api_key):
        message = ("Missing bearer token: send 'Authorization: Bearer <api key>'." if token is None
                   else "Incorrect API key provided.")
        raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


router = APIRouter(dependencies=[Depends(require_debug_access)], include_in_schema=False)


async def read_snapshot(engine) -> dict:
    take = getattr(engine, "kv_snapshot", None)
    if take is None:
        raise APIError(503, f"this engine ({type(engine).__name__}) does not expose its KV block map",
                       code="kv_snapshot_unavailable")
    try:
        snapshot = take()
        if inspect.isawaitable(snapshot):
            snapshot = await snapshot
    except RequestRejected as e:  # the core is not running (stopped, or died)
        raise rejected_to_api_error(e) from None
    snapshot = dict(snapshot)
    if "running" not in snapshot or "waiting" not in snapshot:
        health = engine.health()
        snapshot.setdefault("running", health.get("running", 0))
        snapshot.setdefault("waiting", health.get("waiting", 0))
    snapshot.setdefault("totals", engine_totals(engine))
    return snapshot


def engine_totals(engine) -> dict:
    """The core's all-time totals (from its last step's stats: the same in every API server)."""
    stats = engine.last_core_stats()
    return {"prefill_tokens": stats.prefill_tokens, "generated_tokens": stats.generated_tokens,
            "preemptions": stats.preemptions}


@router.get("/debug/kvcache")
async def kvcache(request: Request) -> JSONResponse:
    return JSONResponse(await read_snapshot(request.app.state.engine))


class SharedMap:
    """The streams' maps, shared: one request to the engine in flight for every watcher, and a map reused
    by those who ask before it is due again (the pacing snapshot_events applies, from the engine's own cost
    of a map). N watchers cost the engine what one does; each asked on its own before (a review: 32
    watchers made 288 maps in 2 s where one made 9)."""

    def __init__(self, engine, interval_s: float = POLL_INTERVAL_S):
        self.engine, self.interval_s = engine, interval_s
        self.pending: asyncio.Future | None = None
        self.snapshot: dict | None = None
        self.due = 0.0  # time.monotonic() from which the map is asked for again

    async def take(self) -> dict:
        if self.pending is not None and self.pending.get_loop() is not asyncio.get_running_loop():
            self.pending = None  # left by a loop that ended mid-read (tests run an app under several)
        if self.pending is None and (self.snapshot is None or time.monotonic() >= self.due):
            self.pending = asyncio.ensure_future(self._read())
        if self.pending is None:
            return self.snapshot
        return await asyncio.shield(self.pending)  # a watcher leaving does not cancel the others' map

    async def _read(self) -> dict:
        start = time.monotonic()
        try:
            self.snapshot = await read_snapshot(self.engine)
        finally:
            cost = time.monotonic() - start
            self.due = start + max(self.interval_s, cost / MAX_WATCH_SHARE)
            self.pending = None
        return self.snapshot


@router.get("/debug/kvcache/stream")
async def kvcache_stream(request: Request) -> StreamingResponse:
    state = request.app.state
    if getattr(state, "kv_map", None) is None:
        state.kv_map = SharedMap(state.engine)
    await state.kv_map.take()  # answer 503 now, not inside a 200 stream, when the engine has no map
    events = snapshot_events(state.kv_map.take, request.is_disconnected)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def snapshot_events(take: Callable[[], Awaitable[dict]], is_disconnected: Callable[[], Awaitable[bool]],
                          interval_s: float = POLL_INTERVAL_S) -> AsyncIterator[str]:
    """``data: <map>`` events: the first map, then each map that differs from the one sent before; an
    OpenAI error body as the last event if the engine stops answering."""
    sent = None
    while not await is_disconnected():
        start = time.monotonic()
        try:
            snapshot = await take()
        except APIError as e:
            yield f"data: {json.dumps(error_body(e.status, e.message, e.param, e.code))}\n\n"
            return
        data = json.dumps(snapshot, separators=(",", ":"))
        cost = time.monotonic() - start
        if data != sent:
            sent = data
            yield f"data: {data}\n\n"
        await asyncio.sleep(max(interval_s, cost * (1 - MAX_WATCH_SHARE) / MAX_WATCH_SHARE))
