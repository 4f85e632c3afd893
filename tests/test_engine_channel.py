"""OutputChannel: the per-request FIFO the engine thread fills (call_soon_threadsafe) and generate drains."""

from __future__ import annotations

import asyncio

import pytest

from server.api.output_channel import OutputChannel


def test_fifo_wakes_the_reader_and_survives_a_cancelled_read():
    async def main():
        ch = OutputChannel(asyncio.get_running_loop())
        ch.put("a")
        ch.put("b")
        assert [await ch.get(), await ch.get()] == ["a", "b"]
        reader = asyncio.ensure_future(ch.get())
        await asyncio.sleep(0)
        assert not reader.done()
        ch.put("c")
        assert await asyncio.wait_for(reader, 1) == "c"
        cancelled = asyncio.ensure_future(ch.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        ch.put("d")  # the cancelled reader's waiter is done: no InvalidStateError
        ch.put("e")
        assert [await ch.get(), await ch.get()] == ["d", "e"]

    asyncio.run(main())
