"""The engine-core process: builds the core (model, runner, KV cache) and runs its CoreLoop over ZeroMQ.

Started with the spawn method (a fresh interpreter: CUDA is initialised here, never inherited). It
connects a PULL socket (messages from the API process) and a PUSH socket (messages to it), sends Ready with
the facts of what it built, or StartupFailed with the error, then loops. It ignores SIGINT and SIGTERM
(a terminal's Ctrl-C reaches the whole process group, systemd signals the whole cgroup): the API process
drains the requests first and then sends Shutdown. It exits by itself when its parent is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import zmq

from server.engine.core_loop import CoreLoop
from server.engine.engine import EngineConfig, build_core
from server.engine.wire import FromCore, Ready, StartupFailed, ToCore, encoder, to_core_decoder

PARENT_CHECK_MS = 1000  # an idle core looks for its parent this often


def run_core_process(config: EngineConfig, to_core: str, from_core: str, log_level: str) -> None:
    """Spawn target. `to_core` / `from_core`: the ipc:// addresses the API process bound."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(to_core)
    push.connect(from_core)
    enc, dec = encoder(), to_core_decoder()

    def send(msg: FromCore) -> None:
        push.send(enc.encode(msg), copy=False)

    def check_parent() -> None:
        if os.getppid() != parent:
            sys.exit("pagewalk engine core: the API process is gone")

    def receive(timeout: float | None) -> list[ToCore]:
        check_parent()  # a busy core never blocks below, so it looks here too
        if timeout is None:
            while not pull.poll(PARENT_CHECK_MS):
                check_parent()
        elif timeout > 0:
            pull.poll(int(timeout * 1000))
        messages = []
        while True:
            try:
                messages.append(dec.decode(pull.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages

    try:
        core, info = build_core(config)
    except BaseException as e:  # reported to the parent, which raises it: the server does not start
        lines = traceback.format_exception(type(e), e, e.__traceback__)
        send(StartupFailed(f"{type(e).__name__}: {e}\n{''.join(lines[-4:])}"))
        push.close(linger=5000)
        sys.exit(1)
    send(Ready(info))
    CoreLoop(core, receive, send).run()
    push.close(linger=5000)  # the last StepUpdate (the aborts) reaches the API process before we go
    pull.close(linger=0)
    ctx.term()
    logging.shutdown()
    # The interpreter's own teardown (torch's modules, the model's tensors) takes ~0.8 s of the API process's
    # shutdown budget on a 2-core machine and has nothing left to do: the sockets are flushed, logs written.
    os._exit(0)
