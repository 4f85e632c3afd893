"""How the API process talks to its engine core: one interface, two carriers.

- `ProcessCoreClient` (serving): the core in its own spawned process, messages over ZeroMQ PUSH/PULL on
  ipc:// sockets in a private temp dir, msgpack-encoded (msgspec). A receiver thread reads the core's
  messages and watches the process sentinel, so a dead core is noticed at once.
- `ThreadCoreClient` (unit tests, `--engine-in-process`): the same CoreLoop on a thread, messages passed as
  objects through a queue.

Both call `on_message(msg)` and `on_death(reason)` on their own thread, never on an event loop.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import zmq

from server.engine.core_loop import CoreLoop
from server.engine.core_process import run_core_process
from server.engine.engine import EngineConfig, build_core
from server.engine.wire import (
    CoreInfo,
    FromCore,
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


class CoreClient(Protocol):
    mode: str  # "process" | "thread"
    info: CoreInfo

    def start(self, on_message: OnMessage, on_death: OnDeath) -> None: ...

    def send(self, msg: ToCore) -> None: ...  # any thread

    def close(self, timeout: float) -> None: ...  # Shutdown, then wait for the core to end


class CoreStartupError(RuntimeError):
    """The engine core could not be built (bad model path, out of memory, ...): the server cannot start."""


class ThreadCoreClient:
    mode = "thread"

    def __init__(self, config: EngineConfig):
        self.core, self.info = build_core(config)
        self._inbox: queue.SimpleQueue[ToCore] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_message: OnMessage, on_death: OnDeath) -> None:
        loop = CoreLoop(self.core, self._receive, on_message)

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

    def close(self, timeout: float) -> None:
        if self._thread is not None:
            self.send(Shutdown())
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _receive(self, timeout: float | None) -> list[ToCore]:
        try:
            messages = [self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages


class ProcessCoreClient:
    mode = "process"

    def __init__(self, config: EngineConfig, log_level: str = "info"):
        self._dir = Path(tempfile.mkdtemp(prefix="pagewalk-core-"))
        to_core, from_core = f"ipc://{self._dir}/to_core", f"ipc://{self._dir}/from_core"
        self._ctx = zmq.Context()
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never block or drop: admission bounds what is queued
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._push.bind(to_core)
        self._pull.bind(from_core)
        self._enc, self._dec = encoder(), from_core_decoder()
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe; sends come from any thread
        self._closing = False
        self._receiver: threading.Thread | None = None
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=run_core_process, args=(config, to_core, from_core, log_level),
                                   name="pagewalk-core", daemon=True)
        self.process.start()
        logger.info("engine core process started (pid %d)", self.process.pid)
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._stop_process(timeout=5)
            self._release()
            raise

    def _wait_ready(self) -> CoreInfo:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._pull in ready:
                msg = self._dec.decode(self._pull.recv())
                if isinstance(msg, Ready):
                    return msg.info
                assert isinstance(msg, StartupFailed), msg
                raise CoreStartupError(f"the engine core failed to start: {msg.error}")
            if self.process.sentinel in ready:
                self.process.join()
                raise CoreStartupError(
                    f"the engine core process exited during start-up (exit code {self.process.exitcode})")

    def start(self, on_message: OnMessage, on_death: OnDeath) -> None:
        self._receiver = threading.Thread(target=self._receive_loop, args=(on_message, on_death),
                                          name="pagewalk-core-receiver", daemon=True)
        self._receiver.start()

    def send(self, msg: ToCore) -> None:
        data = self._enc.encode(msg)
        with self._send_lock:
            if not self._closing or isinstance(msg, Shutdown):
                self._push.send(data, copy=False)

    def close(self, timeout: float) -> None:
        self._closing = True  # first: the receiver must not take the exit that follows for a death
        if self.process.is_alive():
            self.send(Shutdown())
        self._stop_process(timeout)
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._release()

    def _receive_loop(self, on_message: OnMessage, on_death: OnDeath) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(RECEIVE_POLL_MS))
            if self._pull in ready:
                self._drain(on_message)
            elif self.process.sentinel in ready:
                self._drain(on_message)  # whatever it sent before it ended
                if not self._closing:  # closing: close() reaps it (two threads reaping race on waitpid)
                    self.process.join()
                    logger.error("engine core process died (exit code %s)", self.process.exitcode)
                    on_death(f"exit code {self.process.exitcode}")
                return
            elif self._closing:
                return

    def _drain(self, on_message: OnMessage) -> None:
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                on_message(self._dec.decode(frame.buffer))
            except Exception:  # a bug in a handler must not stop the receiver
                logger.exception("could not handle a message from the engine core")

    def _stop_process(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("engine core did not stop in %.0f s; terminating it", timeout)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def _release(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
