"""disconnects.unless_disconnected: the work it awaits ends as its caller is cancelled; the work's error is
read all the same, so asyncio logs no "Future exception was never retrieved" (a review saw it when a handler
was cancelled during its grammar check)."""

from __future__ import annotations

import asyncio
import gc

from server.api.disconnects import unless_disconnected
from server.api.errors import APIError


class ConnectedRequest:
    async def is_disconnected(self) -> bool:
        return False


def test_a_cancelled_caller_leaves_no_unread_error_of_its_work():
    reported = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
        work = asyncio.get_running_loop().create_future()
        caller = asyncio.ensure_future(unless_disconnected(ConnectedRequest(), work))
        await asyncio.sleep(0)  # the caller waits on the work
        work.set_exception(APIError(400, "bad grammar"))
        caller.cancel()  # in the same turn: the caller wakes cancelled, its work done with an error
        await asyncio.gather(caller, return_exceptions=True)
        assert caller.cancelled()
        del work, caller
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert not [c for c in reported if "never retrieved" in c.get("message", "")], reported
