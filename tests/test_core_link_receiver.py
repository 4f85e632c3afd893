"""The API side of the ZeroMQ link (server/engine/core_client.py) under a core that never stops sending: the
receiver sends what waits to go out and sees close() between bounded drains (cases from a review)."""
from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest
import zmq

from server.engine.core_client import AttachedCoreClient
from server.engine.outputs import CoreStats, StepUpdate
from server.engine.wire import Abort, CoreInfo, Hello, Ready, encoder, to_core_decoder

pytestmark = pytest.mark.timeout(60)

INFO = CoreInfo(model="tiny", device="cpu", dtype="float32", attention_backend="torch", cuda_graphs=False,
                block_size=16, num_blocks=64, capacity_tokens=1008, max_model_len=512, vocab_size=259)


def _flooding_core(address):
    """A core on `address` that answers Hello and then sends its client a StepUpdate every 0.5 ms, until the
    returned stop event; -> (set once an Abort arrives, stop, its thread)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    enc, dec = encoder(), to_core_decoder()
    got_abort = threading.Event()
    stop = threading.Event()

    def core():
        client = None
        stats = CoreStats(1, 0, 10, 1, 0, 0.0)
        while not stop.is_set():
            while router.poll(0):
                ident, frame = router.recv_multipart()
                msg = dec.decode(frame)
                if isinstance(msg, Hello):
                    client = ident
                    router.send_multipart([ident, enc.encode(Ready(INFO))])
                elif isinstance(msg, Abort):
                    got_abort.set()
            if client is not None:
                router.send_multipart([client, enc.encode(StepUpdate([], stats, 1))])
            time.sleep(0.0005)
        router.close(linger=0)
        ctx.term()

    t = threading.Thread(target=core, daemon=True)
    t.start()
    return got_abort, stop, t


def test_close_under_a_steady_flow_stops_the_receiver_before_closing_its_socket():
    """An API server's close() (its drain on SIGTERM, while the other servers' streams keep the core
    stepping) joins the receiver for its timeout, then closes the zmq socket under a receiver that is still
    inside _drain (which never looks at the closing flag): a zmq socket used by two threads (here a
    ZMQError 'Socket operation on non-socket' in the receiver; zmq sockets are not thread-safe, so worse is
    possible)."""
    d = tempfile.mkdtemp(prefix="rl-")
    _, stop, t = _flooding_core(f"ipc://{d}/core")
    errors = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: errors.append(repr(a.exc_value))
    try:
        client = AttachedCoreClient(f"ipc://{d}/core", os.getpid())
        client.start(lambda msg: time.sleep(0.001), lambda reason: None)
        time.sleep(0.3)
        client.close(timeout=1.0)
        receiver = client._receiver
        receiver.join(2)
        assert not receiver.is_alive() and not errors, (receiver.is_alive(), errors)
    finally:
        threading.excepthook = old_hook
        stop.set()
        t.join(2)


def test_outbound_messages_are_not_starved_while_the_core_keeps_sending():
    """A core that sends a StepUpdate every 0.5 ms while the receiver takes 1 ms per message (an API server
    whose receiver thread lags: CPU-bound event loop holding the GIL, a loaded host): the receiver thread is
    the socket's only user and only flushes the outbox between drains, and _drain reads until the socket is
    empty -- which it never is. An Abort (a client's hang-up, a stop string) or a new request is then never
    sent while the flow lasts."""
    address = f"ipc://{tempfile.mkdtemp(prefix='rl-')}/core"
    got_abort, stop, t = _flooding_core(address)
    client = AttachedCoreClient(address, os.getpid())
    try:
        client.start(lambda msg: time.sleep(0.001), lambda reason: None)
        time.sleep(0.2)
        client.send(Abort("some-request"))
        sent = time.monotonic()
        arrived = got_abort.wait(3.0)
        assert arrived, "the Abort never left the API process in 3 s while StepUpdates kept coming"
        assert time.monotonic() - sent < 0.5
    finally:
        stop.set()
        t.join(2)
        client.close(timeout=2)
