"""The core's watch over its clients (server/engine/core_process.py ClientWatch) and the clients' heartbeat:
a client that takes StepUpdates and sends nothing for SILENT_S is hung (a SIGSTOPped API server's requests
ran on to max_tokens while the core queued its updates without bound: a review), killed and reported Gone."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import zmq

from server.engine import core_process
from server.engine.core_client import AttachedCoreClient
from server.engine.core_process import ClientWatch
from server.engine.wire import (
    HEARTBEAT_S,
    SILENT_S,
    Gone,
    Hello,
    Ping,
    Ready,
    encoder,
    to_core_decoder,
)
from tests.test_core_link_receiver import INFO

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


BASE = time.monotonic()


def later(monkeypatch, seconds: float) -> None:
    """The watch's clock, `seconds` after BASE."""
    monkeypatch.setattr(core_process.time, "monotonic", lambda: BASE + seconds)


def test_a_silent_client_is_killed_and_gone(sleeper, monkeypatch):
    later(monkeypatch, 0)
    watch = ClientWatch()
    watch.add(b"api", sleeper.pid, updates=True)
    assert watch.gone() == []
    later(monkeypatch, SILENT_S + 1)
    assert watch.gone() == [(b"api", Gone())]
    assert sleeper.wait(5) == -9
    assert watch.gone() == []  # reported once


def test_a_client_heard_from_is_alive(sleeper, monkeypatch):
    later(monkeypatch, 0)
    watch = ClientWatch()
    watch.add(b"api", sleeper.pid, updates=True)
    later(monkeypatch, SILENT_S - 1)
    watch.heard(b"api")
    later(monkeypatch, SILENT_S + 1)  # heard 2 s ago
    watch.next_look = 0.0
    assert watch.gone() == [] and sleeper.poll() is None


def test_a_control_client_is_never_taken_for_hung(sleeper, monkeypatch):
    """The supervisor says Hello without taking updates and may say nothing for hours."""
    later(monkeypatch, 0)
    watch = ClientWatch()
    watch.add(b"supervisor", sleeper.pid, updates=False)
    later(monkeypatch, 10 * SILENT_S)
    assert watch.gone() == [] and sleeper.poll() is None


def test_an_idle_client_pings_its_core():
    """A core that answers the handshake and then says nothing: the client's receiver says it is alive."""
    address = f"ipc://{tempfile.mkdtemp(prefix='pw-ping-')}/core"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    enc, dec = encoder(), to_core_decoder()
    got: list = []
    stop = threading.Event()

    def core():
        while not stop.is_set():
            if router.poll(50):
                ident, frame = router.recv_multipart()
                got.append(dec.decode(frame))
                if isinstance(got[-1], Hello):
                    router.send_multipart([ident, enc.encode(Ready(INFO))])

    thread = threading.Thread(target=core, daemon=True)
    thread.start()
    client = AttachedCoreClient(address, os.getpid())
    try:
        client.start(lambda msg: None, lambda reason: None)
        start = time.monotonic()
        while time.monotonic() - start < 3 * HEARTBEAT_S and not any(isinstance(m, Ping) for m in got):
            time.sleep(0.05)
        assert isinstance(got[0], Hello) and any(isinstance(m, Ping) for m in got), got
    finally:
        client.close(timeout=2)
        stop.set()
        thread.join(2)
        router.close(linger=0)
        ctx.term()
