"""How an API process talks to its engine core: one interface, three carriers.

- `ProcessCoreClient` (serving): the core in its own spawned process, this process its parent. The core
  binds a ZeroMQ ROUTER on an ipc:// socket in a private temp dir; the client connects a DEALER, says Hello
  and waits for Ready; messages are msgpack-encoded (msgspec). A receiver thread reads the core's messages
  and watches the process sentinel, so a dead core is noticed at once.
- `AttachedCoreClient` (each API server of `--api-server-count N`): the same link to a core another process
  started (the servers' supervisor); it watches the core's pid through a pidfd, and leaves the core's
  shutdown to the process that started it.
- `ThreadCoreClient` (unit tests, `--engine-in-process`): the same CoreLoop on a thread, messages passed as
  objects through a queue.

All call `on_message(msg)` and `on_death(reason)` on their own thread, never on an event loop.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import zmq

from server.engine.core_loop import CoreLoop
from server.engine.core_process import run_core_process
from server.engine.engine import EngineConfig, build_core
from server.engine.wire import (
    HEARTBEAT_S,
    CoreInfo,
    FromCore,
    Hello,
    Ping,
    Ready,
    Shutdown,
    StartupFailed,
    ToCore,
    encoder,
    from_core_decoder,
)

logger = logging.getLogger("pagewalk.engine")

OnMessage = Callable[[FromCore], None]
OnDeath = Callable[[str], None]
RECEIVE_POLL_MS = 100  # the receiver looks at its stop flag this often
# a core told to stop exits within this (a CUDA context's teardown takes a second or two); past it the core
# is hung and is killed: it ignores SIGTERM and SIGINT (they are the API process's to handle), so only
# SIGKILL stops it (a review: a hung idle core held a SIGTERM'd server 15 s, 10 s waiting, 5 s terminating)
STOP_WAIT_S = 5.0
IN_PROCESS = b"in-process"  # the thread client's id in its CoreLoop


class CoreClient(Protocol):
    mode: str  # "process" | "thread"
    info: CoreInfo
    stopped_by_force: bool  # close() had to terminate or kill the core: it did not stop when asked

    def start(self, on_message: OnMessage, on_death: OnDeath) -> None: ...

    def send(self, msg: ToCore) -> None: ...  # any thread

    # Shutdown (if it started the core), then wait for its end; hung: the core answers nothing (a stopped
    # process): a core process of its own is killed at once, not asked and waited for
    def close(self, timeout: float, hung: bool = False) -> None: ...

    # the CPU time the core (its process, or its thread) has used, in seconds; None where it cannot be read
    def core_cpu_seconds(self) -> float | None: ...


def cpu_seconds(stat_path: str) -> float | None:
    """utime + stime of a process or thread from its /proc stat file (Linux); None elsewhere or once it
    has gone. The fields after the command's closing parenthesis start at the state (field 3 of proc(5))."""
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CoreStartupError(RuntimeError):
    """The engine core could not be built (bad model path, out of memory, ...): the server cannot start."""


class ThreadCoreClient:
    mode = "thread"
    stopped_by_force = False  # a thread cannot be killed: close() waits up to its timeout

    def __init__(self, config: EngineConfig):
        try:
            self.core, self.info = build_core(config)
        except Exception as e:  # as the core process reports it: one line, no traceback (out of memory, ...)
            raise CoreStartupError(f"{type(e).__name__}: {e}") from e
        self._inbox: queue.SimpleQueue[ToCore] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_message: OnMessage, on_death: OnDeath) -> None:
        def send(_client, msg: FromCore) -> None:
            if isinstance(msg, Ready):  # the answer to our own Hello below
                return
            try:
                on_message(msg)
            except Exception:  # a bug in a handler must not stop the core (as the socket clients' receiver)
                logger.exception("could not handle a message from the engine core")

        loop = CoreLoop(self.core, self.info, self._receive, send)
        self._inbox.put(Hello())

        def run() -> None:
            try:
                loop.run()
            except BaseException as e:
                logger.exception("engine core thread died")
                on_death(f"{type(e).__name__}: {e}")

        self._thread = threading.Thread(target=run, name="pagewalk-core", daemon=True)
        self._thread.start()

    def send(self, msg: ToCore) -> None:
        self._inbox.put(msg)

    def close(self, timeout: float, hung: bool = False) -> None:
        if self._thread is not None:
            self.send(Shutdown())
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def core_cpu_seconds(self) -> float | None:
        thread = self._thread
        return None if thread is None else cpu_seconds(f"/proc/self/task/{thread.native_id}/stat")

    def _receive(self, timeout: float | None) -> list[tuple[bytes, ToCore]]:
        try:
            messages = [self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return [(IN_PROCESS, m) for m in messages]


class _SocketCoreClient:
    """A DEALER connected to the core's ROUTER, and the receiver thread that reads it. Subclasses give the
    file descriptor that becomes readable when the core process ends, and what to say about its end.

    A zmq socket is not thread-safe, even with one thread sending and another receiving: once the receiver
    runs, it is the socket's only user. send() (from any thread) queues the frame and wakes the receiver
    through a socket pair in its poll; before start() and after the receiver has stopped, send() writes
    to the socket itself."""

    mode = "process"

    def __init__(self, address: str):
        self.address = address
        self.stopped_by_force = False
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never block or drop: admission bounds what is queued
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(address)
        self._enc, self._dec = encoder(), from_core_decoder()
        self._send_lock = threading.Lock()  # orders the queue and the closing flag against each other
        self._outbox: collections.deque[bytes] = collections.deque()  # frames for the receiver to send
        self._wake_r, self._wake_w = socket.socketpair()  # a byte on _wake_w: the outbox has frames
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._receiving = False  # the receiver thread owns the socket
        self._closing = False
        self._ping = self._enc.encode(Ping())  # the receiver's, sent when nothing else went for HEARTBEAT_S
        self._last_sent = time.monotonic()
        self._receiver: threading.Thread | None = None

    def _death_fd(self) -> int: ...

    def _death_reason(self) -> str: ...

    def _handshake(self, updates: bool = True) -> CoreInfo:
        """Hello, then the core's Ready (its facts) or StartupFailed, or its process's end."""
        self.send(Hello(updates, os.getpid()))
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._death_fd(), zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._sock in ready:
                msg = self._dec.decode(self._sock.recv())
                if isinstance(msg, Ready):
                    return msg.info
                if isinstance(msg, StartupFailed):
                    raise CoreStartupError(f"the engine core failed to start: {msg.error}")
            elif ready:
                reason = self._death_reason()
                raise CoreStartupError(f"the engine core process exited during start-up ({reason})")

    def start(self, on_message: OnMessage, on_death: OnDeath) -> None:
        self._receiver = threading.Thread(target=self._receive_loop, args=(on_message, on_death),
                                          name="pagewalk-core-receiver", daemon=True)
        with self._send_lock:
            self._receiving = True
        self._receiver.start()

    def send(self, msg: ToCore) -> None:
        data = self._enc.encode(msg)
        with self._send_lock:
            if self._closing and not isinstance(msg, Shutdown):
                return
            if not self._receiving:
                self._sock.send(data, copy=False)
                return
            self._outbox.append(data)
        with contextlib.suppress(BlockingIOError):  # a full pair already holds a wake-up
            self._wake_w.send(b"\0")

    def _flush_outbox(self) -> None:
        """Send the queued frames, in order (the socket's one user calls this)."""
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        while self._outbox:
            self._sock.send(self._outbox.popleft(), copy=False)
            self._last_sent = time.monotonic()

    def _stop_receiving(self, timeout: float) -> None:
        """closing is set: the receiver leaves its loop; the socket is then this thread's, with what the
        receiver had not sent yet."""
        if self._receiver is not None:
            self._receiver.join(timeout)
        with self._send_lock:
            self._receiving = False
            if self._receiver is None or not self._receiver.is_alive():
                self._flush_outbox()

    def _receive_loop(self, on_message: OnMessage, on_death: OnDeath) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        death = self._death_fd()
        poller.register(death, zmq.POLLIN)
        wake = self._wake_r.fileno()
        poller.register(wake, zmq.POLLIN)
        # the stop flag is looked at every round, not only in quiet ones: a core serving other clients
        # sends this one a StepUpdate every step, and close() must not wait out its join timeout and then
        # close the socket under a receiver still polling it (an API server's drain on SIGTERM, while
        # another server's streams run on)
        while not self._closing:
            ready = dict(poller.poll(RECEIVE_POLL_MS))
            if time.monotonic() - self._last_sent >= HEARTBEAT_S:  # alive: the core ends silent clients
                self._sock.send(self._ping)
                self._last_sent = time.monotonic()
            if wake in ready:
                self._flush_outbox()
            if self._sock in ready:
                self._drain(on_message)
                self._flush_outbox()  # (the wake byte, if any, is read by the next round's flush)
            elif death in ready:
                self._drain(on_message)  # whatever it sent before it ended
                if not self._closing:  # closing: close() reaps it (two threads reaping race on waitpid)
                    reason = self._death_reason()
                    logger.error("engine core process died (%s)", reason)
                    on_death(reason)
                return

    def _drain(self, on_message: OnMessage) -> None:
        """The frames waiting, up to DRAIN_FRAMES: then the loop flushes the outbox and looks at the stop flag
        again. Draining until the socket was empty sent no add or abort, and let close() release the socket
        under it, for as long as the core sent faster than the handler took its frames (a review)."""
        for _ in range(DRAIN_FRAMES):
            if self._closing:
                return
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                on_message(self._dec.decode(frame.buffer))
            except Exception:  # a bug in a handler must not stop the receiver
                logger.exception("could not handle a message from the engine core")

    def _release(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()


DRAIN_FRAMES = 64  # frames the receiver takes in a row before it sends what waits to go out

SUN_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path holds 108 with the NUL)


def _socket_dir() -> Path:
    """A fresh directory for the core's socket: under $TMPDIR, or under /tmp where $TMPDIR makes the socket's
    path too long for a Unix socket (HPC scratch directories)."""
    for parent in (None, "/tmp"):
        try:
            path = Path(tempfile.mkdtemp(prefix="pagewalk-core-", dir=parent))
        except OSError:
            continue
        if len(os.fsencode(path / "core")) <= SUN_PATH_MAX:
            return path
        path.rmdir()
    raise ValueError(f"no directory for the engine core's socket: none could be made under "
                     f"{tempfile.gettempdir()} (TMPDIR) or /tmp with a path a Unix socket takes "
                     f"({SUN_PATH_MAX} bytes); set TMPDIR to a short, writable directory")


class ProcessCoreClient(_SocketCoreClient):
    """Starts the core process and owns it: close() shuts it down. `updates` False: a client that only
    controls the core (the supervisor of several API servers, which attach to it)."""

    def __init__(self, config: EngineConfig, log_level: str = "info", updates: bool = True):
        self._dir = _socket_dir()
        try:
            super().__init__(f"ipc://{self._dir}/core")
        except BaseException as e:
            shutil.rmtree(self._dir, ignore_errors=True)
            if isinstance(e, zmq.ZMQError):
                raise OSError(f"cannot open the engine core's socket in {self._dir}: {e}") from None
            raise
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=run_core_process,
                                   args=(config, self.address, log_level, os.getpid()),
                                   name="pagewalk-core", daemon=True)
        self.process.start()
        logger.info("engine core process started (pid %d)", self.process.pid)
        try:
            self.info = self._handshake(updates)
        except Exception:  # a core that could not start exits by itself
            self._stop_process(STOP_WAIT_S)
            self._release()
            raise
        except BaseException:  # Ctrl-C (or an exit) while it starts: nothing of it is worth waiting for
            self._kill()
            self._release()
            raise

    def core_cpu_seconds(self) -> float | None:
        return cpu_seconds(f"/proc/{self.process.pid}/stat")

    def _death_fd(self) -> int:
        return self.process.sentinel

    def _death_reason(self) -> str:
        self.process.join()
        return f"exit code {self.process.exitcode}"

    def close(self, timeout: float, hung: bool = False) -> None:
        self._closing = True  # first: the receiver must not take the exit that follows for a death
        self._stop_receiving(timeout)  # then the socket is this thread's: the queued frames, Shutdown
        if hung:
            self._kill()
        else:
            if self.process.is_alive():
                self.send(Shutdown())
            self._stop_process(timeout)
        self._release()

    def _stop_process(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("engine core did not stop in %.0f s; killing it", timeout)
        self._kill()

    def _kill(self) -> None:
        """SIGKILL, which a stopped process does not hold pending as it holds SIGTERM."""
        if self.process.is_alive():
            self.stopped_by_force = True
            self.process.kill()
        self.process.join()

    def _release(self) -> None:
        super()._release()
        shutil.rmtree(self._dir, ignore_errors=True)


class AttachedCoreClient(_SocketCoreClient):
    """The link of one API server to a core that its supervisor started (process `pid`, bound at
    `address`). The pidfd makes the core's end readable here as a child's sentinel is to its parent."""

    def __init__(self, address: str, pid: int):
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)  # Linux 5.3+
        super().__init__(address)
        try:
            self.info = self._handshake()
        except BaseException:
            self._release()
            raise

    def _death_fd(self) -> int:
        return self._pidfd

    def _death_reason(self) -> str:
        return f"pid {self.pid} exited"

    def core_cpu_seconds(self) -> float | None:
        return cpu_seconds(f"/proc/{self.pid}/stat")

    def close(self, timeout: float, hung: bool = False) -> None:
        """Stop reading; the core goes on (the supervisor shuts it down once every API server is done).
        hung: this server found the core hung (aborts unanswered), and kills it (SIGKILL through the pidfd,
        which cannot reach another process that took the pid); the other servers see it end and fail
        their requests, and the supervisor exits 1, within the shutdown timeout as one API process does."""
        self._closing = True
        self._stop_receiving(timeout)
        if hung:
            self.stopped_by_force = True
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self._release()

    def _release(self) -> None:
        super()._release()
        os.close(self._pidfd)
