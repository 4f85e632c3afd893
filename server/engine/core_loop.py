"""CoreLoop: drives one EngineCore, in its own process or on a thread of the API process.

Each turn takes every message waiting (hellos, adds, aborts, queries) without blocking, runs one step while
there is work, and sends each client one StepUpdate: the choices of its requests that changed, the core's
stats and how many running requests are its own. With no work it blocks until a message comes. Clients are
the API processes (one, or one per API server with --api-server-count) and the supervisor; a client is
known by the id `receive` gives with each of its messages, and says Hello first. The loop is the same
whatever carries the messages: `receive(timeout)` returns the (client, message) pairs waiting (timeout
None: block until one comes; 0: do not wait), `send(client, message)` hands one on.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Hashable

import msgspec

from server.engine.core import EngineCore
from server.engine.outputs import CoreStats, EngineRequest, SeqUpdate, StepUpdate
from server.engine.wire import Abort, CoreInfo, FromCore, Gone, Hello, Query, Ready, Reply, Shutdown, ToCore

logger = logging.getLogger("pagewalk.engine")

STALL_WAIT_S = 0.01  # a step that could schedule nothing (should not happen) waits this long: no spinning


class EngineCoreFatal(RuntimeError):
    """The core can run no step (EngineCore.fatal): its loop ends, and with it the core process (or thread),
    which its clients see as the core's death: every request in flight fails, /health answers 503 and the
    server exits non-zero."""

Client = Hashable  # a client's id: its ZeroMQ routing id, or a constant in-process


class CoreLoop:
    def __init__(self, core: EngineCore, info: CoreInfo,
                 receive: Callable[[float | None], list[tuple[Client, ToCore]]],
                 send: Callable[[Client, FromCore], None]):
        self.core, self.info = core, info
        self.receive = receive
        self.send = send
        self.clients: dict[Client, None] = {}  # those that take StepUpdates, in the order they said Hello
        self.owners: dict[str, Client] = {}  # request id -> the client that added it, until it ends
        self.rejected: list[tuple[Client, list[SeqUpdate]]] = []  # adds refused before they had an owner
        # adds behind a prompt-logprobs add of this turn, in arrival order: that one runs its prompt's
        # forward as it is added, on this thread, so one turn adds at most one such request. A burst of 16
        # (2K-token prompts, CPU) held the loop ~8 s: no step ran and the drain's aborts went unanswered
        # until it took the working core for a hung one (a review).
        self.backlog: deque[tuple[Client, EngineRequest]] = deque()
        self.gone: set[Client] = set()  # clients whose process ended: anything more from them is dropped

    def run(self) -> None:
        """Until a Shutdown message: every request still in the core is then aborted."""
        core, stalled = self.core, False
        while True:
            busy = core.has_work() or self.backlog
            timeout = (STALL_WAIT_S if stalled else 0.0) if busy else None
            messages = self._with_backlog(self.receive(timeout))
            updates: list[SeqUpdate] = []
            stop = changed = forward_added = False
            for client, msg in messages:
                if client in self.gone:  # (a routing id is never used again)
                    continue
                if isinstance(msg, EngineRequest):
                    if forward_added:
                        self.backlog.append((client, msg))
                        continue
                    updates += self._add(client, msg)
                    forward_added = msg.params.prompt_logprobs is not None
                    changed = True
                elif isinstance(msg, Abort):  # (of an add this turn put back in the backlog: it leaves)
                    backlogged = msg.index is None and self._drop_backlogged(client, msg.request_id)
                    if not backlogged and self.owners.get(msg.request_id) == client:
                        updates += core.abort_request(msg.request_id, msg.index)
                    changed = True
                elif isinstance(msg, Query):
                    self.send(client, Reply(msg.call_id, self._query(msg.name)))
                elif isinstance(msg, Hello):
                    self.send(client, Ready(self.info))
                    if msg.updates:  # the core's stats now: an idle core publishes nothing until it steps
                        self.clients[client] = None
                        self.send(client, StepUpdate([], self.core.stats()))
                elif isinstance(msg, Shutdown):
                    stop = True
                elif isinstance(msg, Gone):
                    self._forget(client)  # and its updates of this turn go nowhere either
                    updates = [u for u in updates if u.request_id in self.owners]
                    changed = True
            if stop:
                for client, msg in list(self.backlog):
                    self._drop_backlogged(client, msg.request_id)
                updates += [u for rid in list(core.requests) for u in core.abort_request(rid)]
                self._publish(updates, core.stats())
                return
            if core.has_work():
                step = self._step()
                ran = step.stats.num_prefill_tokens + step.stats.num_decode_tokens
                stalled = not step.updates and ran == 0
                updates += step.updates
                self._publish(updates, step.stats)
                if core.fatal is not None:  # its failed requests are told; the rest learn it from the death
                    raise EngineCoreFatal(core.fatal)
            elif updates or changed:
                self._publish(updates, core.stats())

    def _forget(self, client: Client) -> None:
        """A client whose process ended leaves, and its requests are aborted: their rows and blocks go back
        at once, their updates to nobody."""
        self.gone.add(client)
        self.backlog = deque((own, msg) for own, msg in self.backlog if own != client)
        self.rejected = [(c, failed) for c, failed in self.rejected if c != client]
        self.clients.pop(client, None)
        mine = [rid for rid, owner in self.owners.items() if owner == client]
        aborted = sum(bool(self.core.abort_request(rid)) for rid in mine)
        for rid in mine:
            del self.owners[rid]
        if aborted:
            logger.warning("a client of the engine core ended: its %d requests are aborted", aborted)

    def _with_backlog(self, received: list[tuple[Client, ToCore]]) -> list[tuple[Client, ToCore]]:
        """This turn's messages: the backlog's adds, less those that `received` aborts (each choice ends
        "abort", without its forward: a drain's aborts came behind the adds they end, a review), then
        `received`."""
        for client, msg in received:
            if isinstance(msg, Abort) and msg.index is None:
                self._drop_backlogged(client, msg.request_id)
        messages = [*self.backlog, *received]
        self.backlog.clear()
        return messages

    def _drop_backlogged(self, client: Client, request_id: str) -> bool:
        """An add of `client` still in the backlog leaves it, each choice ended "abort" -> whether one did."""
        for entry in self.backlog:
            own, req = entry
            if own == client and req.request_id == request_id:
                self.backlog.remove(entry)
                self.rejected.append((client, [SeqUpdate(request_id, i, [], None, "abort")
                                               for i in range(req.params.n)]))
                return True
        return False

    def _add(self, client: Client, req: EngineRequest) -> list[SeqUpdate]:
        rid = req.request_id
        # a request in the engine has this id, or another client's ended this turn (this turn's updates still
        # route by it): its updates must not be taken over. Its own client may reuse an id it aborted.
        if rid in self.owners and (self.owners[rid] != client or rid in self.core.requests):
            self.rejected.append((client, _failed(req, f"ValueError: request id {rid!r} is already in the "
                                                       "engine")))
            return []
        self.owners[rid] = client
        try:
            self.core.add_request(req)
            return []
        except Exception as e:  # this request alone fails
            logger.warning("could not add request %s: %s", rid, e)
            return _failed(req, f"{type(e).__name__}: {e}")

    def _publish(self, updates: list[SeqUpdate], stats: CoreStats) -> None:
        """One StepUpdate to every client; the owners of requests that ended are forgotten."""
        owners, clients = self.owners, self.clients
        rejected, self.rejected = self.rejected, []
        if len(clients) == 1:  # one API process: everything is its own
            (client,) = clients
            for _, failed in rejected:
                updates = updates + failed
            self.send(client, StepUpdate(updates, stats, stats.running))
        elif clients:
            mine: dict[Client, list[SeqUpdate]] = {c: [] for c in clients}
            for u in updates:
                box = mine.get(owners.get(u.request_id))
                if box is not None:
                    box.append(u)
            for client, failed in rejected:
                if client in mine:
                    mine[client] += failed
            running = Counter(owners.get(rid) for rid in self.core.running_request_ids())
            for client, own in mine.items():
                self.send(client, StepUpdate(own, stats, running[client]))
        requests = self.core.requests
        for u in updates:
            if u.finish_reason is not None and u.request_id not in requests:
                owners.pop(u.request_id, None)

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


def _failed(req: EngineRequest, error: str) -> list[SeqUpdate]:
    return [SeqUpdate(req.request_id, i, [], None, "error", None, error) for i in range(req.params.n)]
