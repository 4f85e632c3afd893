"""OutputChannel: one request's outputs on its event loop, filled from the engine's receiving thread."""

from __future__ import annotations

import asyncio
from collections import deque

from server.api.outputs import MergedOutput, RequestOutput, merge_outputs


class OutputChannel:
    """An unbounded FIFO with one waiting reader (lighter than asyncio.Queue, which keeps getter/putter
    queues and task accounting). `put` runs on the channel's loop."""

    __slots__ = ("loop", "items", "waiter", "merged")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[RequestOutput] = deque()
        self.waiter: asyncio.Future | None = None
        self.merged: MergedOutput | None = None  # what put_merged extends while its output waits

    def put_merged(self, out: RequestOutput) -> None:
        """put, except that an output still waiting for the reader absorbs `out`: what get_merged would
        return is the same, and a reader that fell behind (a busy event loop) leaves one output waiting, not
        one per step."""
        items = self.items
        if not items:
            self.merged = None
            self.put(out)
            return
        merged = self.merged
        if merged is None or items[-1] is not merged.out:
            merged = self.merged = MergedOutput(items[-1])
            items[-1] = merged.out
        merged.add(out)

    def put(self, out: RequestOutput) -> None:
        self.items.append(out)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():  # done: its reader was cancelled
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while not self.items:
            self.waiter = self.loop.create_future()
            await self.waiter
        return self.items.popleft()

    async def get_merged(self) -> RequestOutput:
        """Everything waiting, as one output (merge_outputs)."""
        first = await self.get()
        if not self.items:
            return first
        rest, self.items = list(self.items), deque()
        return merge_outputs([first, *rest])


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run fn(*args) on `loop` from any thread. A closed loop has nobody left listening: fn runs here, so
    the request's bookkeeping (metrics, finish reasons) still happens."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return
    except RuntimeError:  # closed
        pass
    try:
        fn(*args)
    except RuntimeError:  # a future of the closed loop
        pass
