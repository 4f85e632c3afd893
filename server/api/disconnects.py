"""Work a request waits for, cut short when its client goes away: `unless_disconnected`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from server.api.errors import APIError

T = TypeVar("T")

DISCONNECT_POLL_S = 0.1


class ClientDisconnected(Exception):
    """The client went away before its (non-streaming) answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T],
                              stopping: Callable[[], bool] | None = None) -> T:
    """Awaits `work`, cancelling it (which aborts its engine requests) if the client disconnects, or with a
    503 once `stopping()` says the server drains (work before admission, which the drain does not wait
    for: uvicorn cancelled it at its deadline, a traceback each in the log, a review)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if stopping is not None and stopping():
                raise APIError(503, "The server is shutting down.")
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif not task.cancelled():  # read, in case the caller was cancelled as it ended: an error no one
            task.exception()  # reads logs "Future exception was never retrieved" (a review)
