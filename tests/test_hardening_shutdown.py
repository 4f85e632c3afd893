"""Finding 7 of issue 17: SIGTERM and SIGINT exit 0 within --shutdown-timeout + 2 s whatever the clients do:
one reads its stream, one stopped reading (its buffers full), one never finished its headers. A core that
hangs (answers no abort) is killed at SIGTERM, its streams fail, and the server exits 1."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import termios
import threading
import time

import httpx
import pytest
from server_helpers import Server

from server.api.async_engine import ABORT_WAIT_S
from server.api.connections import SHUTDOWN_STALL_S

pytestmark = pytest.mark.timeout(120)

SHUTDOWN_TIMEOUT_S = 1.0


def stream_body(**fields) -> bytes:
    fields = {"prompt": "hi", "max_tokens": 1500, "stream": True, "ignore_eos": True, **fields}
    body = json.dumps(fields).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def queued_bytes(sock: socket.socket) -> int:
    """The bytes that reached `sock` and wait to be read (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def wait_full(sock: socket.socket, timeout: float = 60) -> None:
    """Until `sock`, never read, holds bytes and no more come for 0.3 s: its receive buffer is full (the
    server's writes to it pause: the ~3 MB it answers with at once are far over any of its buffers)."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        if (n := queued_bytes(sock)) != last:
            last, since = n, time.monotonic()
        elif n > 0 and time.monotonic() - since >= 0.3:
            return
        time.sleep(0.05)
    raise AssertionError(f"the stalled client's buffer never filled ({last} bytes queued)")


@pytest.mark.parametrize("sig, core", [(signal.SIGTERM, "process"), (signal.SIGINT, "thread")])
def test_signal_exits_0_in_time_whatever_the_clients_do(tmp_path, sig, core):
    """The README's bound, from the signal to the exit, once each client is where the test means it to be:
    the reader's stream has begun, the stalled client's buffers have been full for over SHUTDOWN_STALL_S,
    and the half request is within its 10 s header deadline. These are waited for, not slept: a fixed 1.5 s
    on a loaded box sent the signal before the first forward (the core, in the prefill of the stalled
    client's 1,500-token echo, answered no abort in ABORT_WAIT_S and was killed as hung: exit 1, 6.6 and
    11.7 s), or before the stall was a second old (dropped at uvicorn's close, 1.7 s into the drain, not as
    it began); 2 runs of 2 failed beside other load (3.4 and 4.7 s). Waited for, beside 3 busy processes:
    1.28-1.43 s in 6 runs."""
    args = ["--num-blocks", "1024", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    srv = Server(tmp_path, *args, *(["--engine-in-process"] if core == "thread" else []))
    try:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", srv.port))
        # and never reads: the echoed prompt's logprobs (~3 MB at once) fill even autotuned socket buffers
        stalled.sendall(stream_body(prompt="a" * 1500, echo=True, n=4, logprobs=20, max_tokens=400))

        flowing = threading.Event()

        def reader() -> None:
            try:
                with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                                  json={"prompt": "x", "max_tokens": 1500, "stream": True,
                                        "ignore_eos": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            flowing.set()
            except httpx.HTTPError:
                pass

        threading.Thread(target=reader, daemon=True).start()
        assert flowing.wait(60), srv.log.read_text()[-3000:]  # the reader's tokens come
        wait_full(stalled)  # the stalled client's buffers are full: the server's writes to it pause ...
        half = socket.create_connection(("127.0.0.1", srv.port))  # (within its 10 s header deadline)
        half.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never completes its headers
        time.sleep(SHUTDOWN_STALL_S + 0.5)  # ... past SHUTDOWN_STALL_S: dropped as the drain starts
        start = time.monotonic()
        srv.proc.send_signal(sig)
        code = srv.proc.wait(timeout=30)
        elapsed = time.monotonic() - start
        assert code == 0, srv.log.read_text()[-3000:]
        assert elapsed < SHUTDOWN_TIMEOUT_S + 2, (elapsed, srv.log.read_text()[-3000:])
        assert "Traceback" not in srv.log.read_text()
        stalled.close()
        half.close()
    finally:
        srv.stop()


def test_a_hung_core_is_killed_at_sigterm_its_streams_fail_and_the_server_exits_1(tmp_path):
    srv = Server(tmp_path, "--num-blocks", "1024", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    core = srv.core_pid()
    events: list[str] = []
    streaming = threading.Event()

    def reader() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 1500, "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    streaming.set()

    thread = threading.Thread(target=reader, daemon=True)
    try:
        thread.start()
        assert streaming.wait(30)
        os.kill(core, signal.SIGSTOP)  # alive, answering nothing: its stream can neither finish nor abort
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=60)
        elapsed = time.monotonic() - start
        thread.join(10)
        log = srv.log.read_text()
        assert code == 1, log[-3000:]
        assert elapsed < SHUTDOWN_TIMEOUT_S + ABORT_WAIT_S + 3, (elapsed, log[-3000:])
        assert "engine core is hung: 1 aborts unanswered" in log and "Traceback" not in log
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_error" and "engine core is hung" in err["message"]
        with pytest.raises(ProcessLookupError):  # killed and reaped by the server
            os.kill(core, 0)
    finally:
        try:
            os.kill(core, signal.SIGCONT)
        except ProcessLookupError:
            pass
        srv.stop()


def test_sigterm_while_a_request_body_is_still_arriving_answers_503(tmp_path):
    """A client inside its body deadline (1,000 of 20,000 bytes sent) when SIGTERM comes: the drain's 503,
    one info line, exit 0 in time; not uvicorn's cancelled handler with a traceback and no answer (a
    review)."""
    timeout_s = 1.0
    srv = Server(tmp_path, "--num-blocks", "256", "--shutdown-timeout", str(timeout_s))
    sock = None
    try:
        body = json.dumps({"prompt": "x" * 20000, "max_tokens": 4}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:1000])
        time.sleep(1.0)  # the rest would come within the body deadline (10 s + len / 64 KiB/s)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=30)
        elapsed = time.monotonic() - start
        sock.settimeout(5)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
        log = srv.log.read_text()
        assert code == 0 and elapsed < timeout_s + 2, (code, elapsed, log[-3000:])
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
        assert answer.startswith(b"HTTP/1.1 503") and b'"shutting_down"' in answer, answer[:300]
    finally:
        if sock is not None:
            sock.close()
        srv.stop()
