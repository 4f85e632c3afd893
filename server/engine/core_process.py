"""The engine-core process: builds the core (model, runner, KV cache) and runs its CoreLoop over ZeroMQ.

Started with the spawn method (a fresh interpreter: CUDA is initialised here, never inherited). It binds
one ROUTER socket at the address its parent chose; every client (the API process, or each API server and
their supervisor) connects a DEALER to it and says Hello, and the ROUTER's routing ids tell the clients
apart. Once built, the core answers every Hello with Ready (the facts of what it built); if the build fails
it answers the Hellos that came with StartupFailed and exits. It ignores SIGINT and SIGTERM (a terminal's
Ctrl-C reaches the whole process group, systemd signals the whole cgroup): its clients drain the requests
first and then one sends Shutdown. It exits by itself when its parent is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from server.engine.core_loop import Client, CoreLoop, EngineCoreFatal
from server.engine.engine import EngineConfig, build_core
from server.engine.wire import (
    SILENT_S,
    FromCore,
    Gone,
    Hello,
    Ping,
    StartupFailed,
    ToCore,
    encoder,
    to_core_decoder,
)
from server.heap import freeze_startup_heap

logger = logging.getLogger("pagewalk.engine")

PARENT_CHECK_MS = 1000  # an idle core looks for its parent this often
STARTUP_FAILED_WAIT_S = 5.0  # a core that could not be built waits this long for a Hello to answer


def run_core_process(config: EngineConfig, address: str, log_level: str, parent: int | None = None) -> None:
    """Spawn target. `address`: the ipc:// address to bind; `parent`: the pid of the process that started
    it, passed in because a parent killed during the spawn's imports (~2 s) would otherwise be read as
    init's pid 1 and never be missed (the core would then run on, holding its memory)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid() if parent is None else parent
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: the clients' admission bounds what is queued
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    enc, dec = encoder(), to_core_decoder()

    def send(client: Client, msg: FromCore) -> None:
        sock.send_multipart([client, enc.encode(msg)], copy=False)

    watch = ClientWatch()

    def receive(timeout: float | None) -> list[tuple[Client, ToCore]]:
        _exit_if_orphaned(parent)  # a busy core never blocks below, so it looks here too
        if timeout is None:
            while not sock.poll(PARENT_CHECK_MS):
                _exit_if_orphaned(parent)
        elif timeout > 0:
            sock.poll(int(timeout * 1000))
        messages = []
        while True:
            try:
                client, frame = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # a client's last messages come before its Gone
                return messages + watch.gone()
            msg = dec.decode(frame)
            watch.heard(client)
            if isinstance(msg, Ping):
                continue
            if isinstance(msg, Hello):
                watch.add(client, msg.pid, msg.updates)
            messages.append((client, msg))

    _exit_if_orphaned(parent)  # gone already (killed during the spawn): no model to build
    built = _watch_parent_while_building(parent)
    try:
        core, info = build_core(config)
    except BaseException as e:  # reported to the clients, which raise it: the server does not start
        built.set()
        lines = traceback.format_exception(type(e), e, e.__traceback__)
        _answer_hellos(receive, send, StartupFailed(f"{type(e).__name__}: {e}\n{''.join(lines[-4:])}"))
        sock.close(linger=5000)
        sys.exit(1)
    built.set()
    logging.getLogger("pagewalk.engine").info("engine core: start-up heap frozen (%d objects)",
                                              freeze_startup_heap())
    exit_code = 0
    try:
        CoreLoop(core, info, receive, send).run()
    except EngineCoreFatal as e:  # its failed requests' errors reach the clients, then its death the rest
        logging.getLogger("pagewalk.engine").error("engine core: %s; exiting", e)
        exit_code = 1
    sock.close(linger=5000)  # the last StepUpdates (the aborts, or the failed batch) reach the clients first
    ctx.term()
    logging.shutdown()
    # The interpreter's own teardown (torch's modules, the model's tensors) takes ~0.8 s of the API process's
    # shutdown budget on a 2-core machine and has nothing left to do: the socket is flushed, logs written.
    os._exit(exit_code)


class ClientWatch:
    """The clients' processes (their Hellos name them), looked at once a PARENT_CHECK_MS: a client whose
    process has ended (an API server killed; its sockets send nothing on their own) is reported once as
    Gone, so the core stops running its requests, which held their rows and blocks against the other
    servers' requests until the whole server's drain ended (a review). A client that takes StepUpdates and
    has sent nothing, not even its Ping, for SILENT_S is hung (stopped, deadlocked): it is killed, which its
    supervisor sees as any API server's death, and reported Gone (a review: a SIGSTOPped API server's
    requests ran on to max_tokens while the core queued its StepUpdates without bound)."""

    def __init__(self) -> None:
        self.pids: dict[Client, int] = {}
        self.heard_at: dict[Client, float] = {}  # the clients that take StepUpdates: their last message
        self.next_look = 0.0

    def add(self, client: Client, pid: int, updates: bool = True) -> None:
        if pid:
            self.pids[client] = pid
            if updates:
                self.heard_at[client] = time.monotonic()

    def heard(self, client: Client) -> None:
        if client in self.heard_at:
            self.heard_at[client] = time.monotonic()

    def gone(self) -> list[tuple[Client, Gone]]:
        now = time.monotonic()
        if not self.pids or now < self.next_look:
            return []
        self.next_look = now + PARENT_CHECK_MS / 1000
        ended = [c for c, pid in self.pids.items() if not _process_alive(pid)]
        hung = [c for c, at in self.heard_at.items() if now - at > SILENT_S and c not in ended]
        for client in hung:
            pid = self.pids[client]
            logger.error("engine core: client process %d sent nothing for %.0f s (hung): killing it", pid,
                         now - self.heard_at[client])
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for client in ended + hung:
            del self.pids[client]
            self.heard_at.pop(client, None)
        return [(client, Gone()) for client in ended + hung]


def _process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:  # no /proc here
        return True


def _exit_if_orphaned(parent: int) -> None:
    """Once the parent is gone no client will ask for anything: exits at once (the interpreter's teardown of
    torch and the model only takes time and logs native leaks)."""
    if os.getppid() == parent:
        return
    sys.stderr.write("pagewalk engine core: the process that started it is gone\n")
    sys.stderr.flush()
    os._exit(1)


def _watch_parent_while_building(parent: int) -> threading.Event:
    """A thread that ends the process once its parent is gone, until the returned event is set: building the
    core (minutes for a large checkpoint) looks at nothing else, and an orphan would finish loading the
    model into memory nobody frees (a review: 8.5 s on after its supervisor's kill -9, the build done)."""
    built = threading.Event()

    def watch() -> None:
        while not built.wait(PARENT_CHECK_MS / 1000):
            _exit_if_orphaned(parent)

    threading.Thread(target=watch, name="pagewalk-parent-watch", daemon=True).start()
    return built


def _answer_hellos(receive, send, failure: StartupFailed) -> None:
    """Answer with `failure` the Hellos of the first batch of messages that holds one, waiting up to
    STARTUP_FAILED_WAIT_S for it (the client that started the core says Hello at once)."""
    deadline, answered = time.monotonic() + STARTUP_FAILED_WAIT_S, False
    while not answered and (left := deadline - time.monotonic()) > 0:
        for client, msg in receive(min(left, 0.1)):
            if isinstance(msg, Hello):
                send(client, failure)
                answered = True
