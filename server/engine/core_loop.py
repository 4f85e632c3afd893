"""CoreLoop: drives one EngineCore, in its own process or on a thread of the API process.

Each turn takes every message waiting (adds, aborts, queries) without blocking, runs one step while there
is work, and sends one StepUpdate carrying every choice that changed plus the core's stats. With no work
it blocks until a message comes. The loop is the same whatever carries the messages: `receive(timeout)`
returns the messages waiting (timeout None: block until one comes; 0: do not wait), `send` hands one on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from server.engine.core import EngineCore
from server.engine.outputs import EngineRequest, SeqUpdate, StepUpdate
from server.engine.wire import Abort, FromCore, Query, Reply, Shutdown, ToCore

logger = logging.getLogger("pagewalk.engine")

STALL_WAIT_S = 0.01  # a step that could schedule nothing (should not happen) waits this long: no spinning


class CoreLoop:
    def __init__(self, core: EngineCore, receive: Callable[[float | None], list[ToCore]],
                 send: Callable[[FromCore], None]):
        self.core = core
        self.receive = receive
        self.send = send

    def run(self) -> None:
        """Until a Shutdown message: every request still in the core is then aborted."""
        core, stalled = self.core, False
        while True:
            timeout = (STALL_WAIT_S if stalled else 0.0) if core.has_work() else None
            messages = self.receive(timeout)
            updates: list[SeqUpdate] = []
            stop = False
            for msg in messages:
                if isinstance(msg, EngineRequest):
                    updates += self._add(msg)
                elif isinstance(msg, Abort):
                    updates += core.abort_request(msg.request_id, msg.index)
                elif isinstance(msg, Query):
                    self.send(Reply(msg.call_id, self._query(msg.name)))
                elif isinstance(msg, Shutdown):
                    stop = True
            if stop:
                updates += [u for rid in list(core.requests) for u in core.abort_request(rid)]
                self.send(StepUpdate(updates, core.stats()))
                return
            if core.has_work():
                step = self._step()
                ran = step.stats.num_prefill_tokens + step.stats.num_decode_tokens
                stalled = not step.updates and ran == 0
                updates += step.updates
                self.send(StepUpdate(updates, step.stats))
            elif updates or any(not isinstance(m, Query) for m in messages):
                self.send(StepUpdate(updates, core.stats()))

    def _add(self, req: EngineRequest) -> list[SeqUpdate]:
        try:
            self.core.add_request(req)
            return []
        except Exception as e:  # this request alone fails
            logger.warning("could not add request %s: %s", req.request_id, e)
            error = f"{type(e).__name__}: {e}"
            return [SeqUpdate(req.request_id, i, [], None, "error", None, error) for i in range(req.params.n)]

    def _step(self) -> StepUpdate:
        try:
            return self.core.step()
        except Exception as e:  # a bug outside the batch guard: fail everything in flight, keep serving
            logger.exception("engine step crashed")
            error = f"{type(e).__name__}: {e}"
            core = self.core
            updates = [u for rid in list(core.requests)
                       for u in core.abort_request(rid, None, "error", error)]
            return StepUpdate(updates, core.stats())

    def _query(self, name: str) -> dict:
        if name == "stats":
            return msgspec.structs.asdict(self.core.stats())
        if name == "kv_snapshot":
            return self.core.kv_snapshot()
        raise AssertionError(f"unknown query {name!r}")
