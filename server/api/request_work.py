"""Where the work on a request's body runs: inline for small bodies, in a worker thread for large ones.

Validating the body, rendering a chat request's template and tokenizing its prompt, stop and bad words run
in the request's handler. On a large body that work holds the event loop, and with it every other stream's
tokens: a 1 MB chat body of 30,000 short messages took ~160 ms to validate and ~250 ms to render and
encode, a 1 MB text prompt ~95 ms to encode (the CI CPU, tiny preset: a hostile review's measurement). A
worker thread lets the loop keep turning (the tokenizer's Rust code and the template's Python share the
GIL, which switches every 5 ms), as /tokenize already does. The hop itself costs ~0.26 ms of latency on that
CPU (1,000 sequential asyncio.to_thread calls), as much as encoding ~4 KB of text, so bodies up to
INLINE_BODY_BYTES stay inline: a 512-token prompt's body is ~2-3 KB.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import Request

from server.api.disconnects import ClientDisconnected, unless_disconnected
from server.api.errors import APIError

T = TypeVar("T")

INLINE_BODY_BYTES = 4096
SMALL_BODY_BYTES = 64 * 1024  # a long conversation's body; past it, work of up to ~0.5 s (the module doc)
# The work's own threads, not asyncio's default executor: that one also runs the drain (server/api/app.py
# stop_engine), which would otherwise queue behind every large body waiting for a thread (a review: 24
# queued bodies held the drain's start 1.1 s). The GIL lets few of them run at once anyway (four threads on
# gone clients' bodies held a small request 1.3 s where two held it 0.4: a review's case). Bodies up to
# SMALL_BODY_BYTES have threads of their own: a 6 KB chat body waited 3.9 s behind 24 bodies of 1 MB (a
# review), as the grammar checks keep small sources apart.
_WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagewalk-request")
_SMALL_WORKERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagewalk-request-small")


async def run_request_work(request: Request, work: Callable[..., T], *args) -> T:
    """work(*args), in a worker thread when the request's body is larger than INLINE_BODY_BYTES (its
    exceptions, the 400s included, propagate either way). Work whose client goes away before a thread takes
    it never runs (a 499): queued, it held every later body's (the same review: those 24 clients had hung
    up at once)."""
    size = len(await request.body())  # starlette keeps the body once read
    if size <= INLINE_BODY_BYTES:
        return work(*args)
    pool = _SMALL_WORKERS if size <= SMALL_BODY_BYTES else _WORKERS
    try:
        if await request.is_disconnected():  # (gone already: its second stage, after the parse, never queues)
            raise ClientDisconnected
        return await unless_disconnected(request, _run_on(pool, work, *args))
    except ClientDisconnected:
        raise APIError(499, "The client went away while its request was read.") from None


async def run_in_worker(work: Callable[..., T], *args, **kwargs) -> T:
    """work(*args, **kwargs) on one of the request work's threads."""
    return await _run_on(_WORKERS, work, *args, **kwargs)


async def _run_on(executor: ThreadPoolExecutor, work: Callable[..., T], *args, **kwargs) -> T:
    """work(*args, **kwargs) on `executor`, in this task's context (as asyncio.to_thread runs it)."""
    call = functools.partial(contextvars.copy_context().run, work, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(executor, call)


# /tokenize and /detokenize, open without the key where the server has one: a thread of their own and at
# most UTILITY_PENDING calls at a time (429 past it), so that keyless requests never queue the work of the
# /v1 bodies (a review: 16 keyless 1 MB /tokenize bodies held a keyed completion 0.8-1.4 s on this box)
_UTILITY = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagewalk-utility")
UTILITY_PENDING = 8
_utility_calls = 0  # in flight (the event loop's thread alone counts them)


async def run_utility_work(work: Callable[..., T], *args, **kwargs) -> T:
    """work(*args, **kwargs) on the utility thread; a 429 while UTILITY_PENDING calls are in flight."""
    global _utility_calls
    if _utility_calls >= UTILITY_PENDING:
        raise APIError(429, f"{UTILITY_PENDING} tokenize / detokenize calls are in progress; retry shortly.",
                       code="rate_limit_exceeded", headers={"Retry-After": "1"})
    _utility_calls += 1
    try:
        return await _run_on(_UTILITY, work, *args, **kwargs)
    finally:
        _utility_calls -= 1
