"""An attached core client closes promptly while the core keeps sending it updates (another API server's
streams still running): close() stops its receiver within a poll interval instead of waiting out the join
timeout and then closing the socket under a receiver that is still polling it."""

from __future__ import annotations

import os
import threading
import time

import zmq

from server.engine.core_client import RECEIVE_POLL_MS, AttachedCoreClient
from server.engine.engine import EngineConfig, build_core
from server.engine.wire import Hello, Ready, encoder, to_core_decoder


def fake_core(address: str, info, stop: threading.Event, bound: threading.Event) -> None:
    """A ROUTER that answers Hello with Ready, then sends the client a message every millisecond."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    bound.set()
    enc, dec = encoder(), to_core_decoder()
    client = None
    while not stop.is_set():
        if sock.poll(1):
            ident, frame = sock.recv_multipart()
            if isinstance(dec.decode(frame), Hello):
                client = ident
                sock.send_multipart([client, enc.encode(Ready(info))])
        elif client is not None:
            sock.send_multipart([client, enc.encode(Ready(info))])  # any message the client decodes
    sock.close(linger=0)
    ctx.term()


def test_close_returns_within_a_poll_interval_under_constant_traffic(tmp_path):
    _, info = build_core(EngineConfig(model="tiny", device="cpu", dtype="float32", num_blocks=16,
                                      attention_backend="torch"))
    address = f"ipc://{tmp_path}/core"
    stop, bound = threading.Event(), threading.Event()
    core = threading.Thread(target=fake_core, args=(address, info, stop, bound), daemon=True)
    core.start()
    assert bound.wait(10)
    try:
        client = AttachedCoreClient(address, os.getpid())  # the pid only has to stay alive
        received = threading.Semaphore(0)
        client.start(lambda msg: received.release(), lambda reason: None)
        for _ in range(50):  # the traffic is flowing
            assert received.acquire(timeout=5)
        start = time.monotonic()
        client.close(timeout=10.0)
        took = time.monotonic() - start
        assert not client._receiver.is_alive()
        assert took < 5 * RECEIVE_POLL_MS / 1000, f"close took {took:.2f} s"
    finally:
        stop.set()
        core.join(5)
