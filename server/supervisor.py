"""`pagewalk serve --api-server-count N` (N > 1): N API server processes over one engine core.

One API process carries ~30K streamed tokens/s on an H200 host (docs/benchmarks/serving_h200.md: it, not
the core, is the HTTP ceiling above that). This process, the supervisor, runs no HTTP itself:
1. it binds the listening socket (a port in use fails at once, before any model loads);
2. it starts the engine core (ProcessCoreClient, as a control client that takes no StepUpdates) and waits
   until it is built;
3. it spawns N API servers (server.cli.run_api_server) that share the socket: the kernel hands each new
   connection to one of them. Each attaches to the core (AttachedCoreClient) and
   serves exactly as a single API process does; their Prometheus values go to files in a private directory
   that any server's /metrics sums (server.api.metrics);
4. on SIGTERM or SIGINT it passes SIGTERM on: each server drains its own requests and exits; then it shuts
   the core down and exits 0. A server still running --shutdown-timeout + DRAIN_MARGIN_S after the stop
   (stopped, deadlocked) is killed, and the exit is non-zero.
Failures end the whole server with a non-zero exit, so a supervisor above it restarts it: the core dies
(each API server sees its pid end, fails its requests, answers 503 and exits 1), an API server dies or
exits unasked (the others are stopped as on SIGTERM; the core aborts its requests, which nobody can
finish, within a second: server/engine/core_process.py ClientWatch), or
a server finds the core hung at its drain (it kills the core; the others see it end).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

logger = logging.getLogger("pagewalk")

WAIT_S = 0.5  # how often the supervisor looks at its flags between process ends
# past --shutdown-timeout, how long a server told to stop may take before it is killed: a drained server
# exits within ~2 s of its timeout; a hung one (stopped, deadlocked) would hold the core's memory for ever
DRAIN_MARGIN_S = 10.0


def supervise(args: argparse.Namespace) -> int:
    from server.api.metrics import MULTIPROC_DIR_ENV
    from server.cli import engine_config, http_url, startup_failed
    from server.engine.core_client import STOP_WAIT_S, CoreStartupError, ProcessCoreClient
    from server.model.loader import load_tokenizer

    config = engine_config(args)
    try:  # what each server loads first: a bad model, tokenizer or template fails here, once
        load_tokenizer(config.model, config.tokenizer, config.chat_template)
        # bound before the core is built: a port in use or a bad --host fails now, not after the model loads
        sock = listen(args.host, args.port)
    except (ValueError, OSError) as e:
        return startup_failed(e)
    metrics_dir = tempfile.mkdtemp(prefix="pagewalk-metrics-")
    previous = os.environ.get(MULTIPROC_DIR_ENV)
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir  # read by prometheus_client when each server imports it
    core_died = threading.Event()
    servers: list = []
    stopping = threading.Event()
    stop = _stopper(servers, stopping)
    try:
        try:
            core = ProcessCoreClient(config, args.log_level, updates=False)
        except CoreStartupError as e:
            return startup_failed(e)
        try:  # until the handlers below: Ctrl-C or SIGTERM (cli.main's Terminated) raise here
            core.start(lambda msg: None, lambda reason: core_died.set())
            for sig in (signal.SIGTERM, signal.SIGINT):  # from here a signal stops the servers started
                signal.signal(sig, stop)
        except BaseException:  # nothing started is worth a drain; at exit Python would wait for the core
            # (which ignores SIGTERM) without end
            core.close(timeout=STOP_WAIT_S, hung=True)
            raise
        port = sock.getsockname()[1]  # the one the OS chose for --port 0
        try:
            _spawn(servers, stopping, args, core, sock)
        except BaseException:  # a server that could not start (EAGAIN, out of memory, ...): none of it stays
            stop(again=True)
            _reap(servers)
            core.close(timeout=STOP_WAIT_S, hung=True)
            raise
        if stopping.is_set():  # the one that started as the signal came has its SIGTERM now
            stop(again=True)
        logger.info("pagewalk: %d API servers (pids %s) on %s, engine core pid %d", len(servers),
                    ", ".join(str(p.pid) for p in servers), http_url(args.host, port), core.process.pid)
        failed = _wait(servers, core_died, stopping, stop, args.shutdown_timeout + DRAIN_MARGIN_S)
        core.close(timeout=STOP_WAIT_S)
        return 1 if failed or core_died.is_set() or core.stopped_by_force else 0
    finally:
        sock.close()  # every way out before the spawn (which closes it after handing it on: a no-op then)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if previous is None:  # main() may run inside another program (the tests): leave its environment
            os.environ.pop(MULTIPROC_DIR_ENV, None)
        else:
            os.environ[MULTIPROC_DIR_ENV] = previous


def _spawn(servers: list, stopping: threading.Event, args: argparse.Namespace, core, sock) -> None:
    """Starts the N API servers on `sock` (which they hold after; closed here), appending each once it has
    started, so that the handler never signals one half spawned; a signal meanwhile stops the spawning."""
    from server.api.async_engine import ApiServer
    from server.cli import run_api_server

    ctx = multiprocessing.get_context("spawn")
    n = args.api_server_count
    try:
        for i in range(n):
            if stopping.is_set():
                break
            api = ApiServer(i, n, core.address, core.process.pid)
            server = ctx.Process(target=run_api_server, name=f"pagewalk-api-{i}", args=(args, api, sock))
            server.start()
            servers.append(server)
    finally:
        sock.close()


def _reap(servers: list) -> None:
    """Waits STOP_WAIT_S for servers told to stop, then kills those left."""
    from server.engine.core_client import STOP_WAIT_S

    multiprocessing.connection.wait([p.sentinel for p in servers], timeout=STOP_WAIT_S)
    for p in servers:
        if p.is_alive():
            p.kill()
        p.join()


def listen(host: str, port: int) -> socket.socket:
    """The servers' shared listening socket (what uvicorn binds for one process: SO_REUSEADDR, backlog
    2048)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def _stopper(servers: list, stopping: threading.Event):
    """The SIGTERM / SIGINT handler: the first call sets `stopping` and passes SIGTERM on to each server
    started (never SIGINT: a second one makes uvicorn skip draining)."""

    signalled: set[int] = set()

    def stop(*_, again: bool = False) -> None:
        if again or not stopping.is_set():
            stopping.set()
            for p in servers:
                if p.pid not in signalled and p.is_alive():
                    signalled.add(p.pid)
                    os.kill(p.pid, signal.SIGTERM)

    return stop


def _wait(servers: list, core_died: threading.Event, stopping: threading.Event, stop, drain_s: float) -> bool:
    """Until every API server has exited; True if one failed (died, exited non-zero, or was still running
    `drain_s` after the stop and was killed). A dead core makes every server exit non-zero by itself; the
    caller also looks at `core_died`."""
    failed = False
    alive = list(servers)
    deadline = None
    while alive:
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=WAIT_S)
        for p in [p for p in alive if not p.is_alive()]:
            alive.remove(p)
            p.join()
            # a server our SIGTERM reached before it set its handlers (still starting) dies of it: stopped
            # as asked, not failed; one that exits unasked, even with 0 (a SIGTERM sent to it alone: it
            # drained), leaves its share of the admission bound and, for server 0, the core's metrics
            # unserved, so the whole server stops and exits non-zero for its own supervisor to restart it
            asked = stopping.is_set() and p.exitcode in (0, -signal.SIGTERM)
            if not asked:
                failed = True
                logger.error("API server %s exited with code %s%s: stopping the server", p.name, p.exitcode,
                             "" if stopping.is_set() else " unasked")
                stop()
        if core_died.is_set() and not stopping.is_set():
            logger.error("the engine core died: the API servers fail their requests and exit")
            stopping.set()  # each server sees the core's end itself; they exit 1
        if stopping.is_set() and deadline is None:
            deadline = time.monotonic() + drain_s
        if deadline is not None and alive and time.monotonic() > deadline:
            for p in alive:
                logger.error("API server %s still running %.0f s after the stop: killed", p.name, drain_s)
                p.kill()
            failed = True
            deadline = float("inf")  # killed: the loop reaps them
    return failed
