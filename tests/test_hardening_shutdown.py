"""Finding 7 of issue 17: SIGTERM and SIGINT exit 0 within --shutdown-timeout + 2 s whatever the clients do:
one reads its stream, one stopped reading (its buffers full), one never finished its headers. A core that
hangs (answers no abort) is killed at SIGTERM, its streams fail, and the server exits 1."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from server_helpers import Server

from server.api.async_engine import ABORT_WAIT_S

pytestmark = pytest.mark.timeout(120)

SHUTDOWN_TIMEOUT_S = 1.0


def stream_body(**fields) -> bytes:
    fields = {"prompt": "hi", "max_tokens": 1500, "stream": True, "ignore_eos": True, **fields}
    body = json.dumps(fields).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


@pytest.mark.parametrize("sig, core", [(signal.SIGTERM, "process"), (signal.SIGINT, "thread")])
def test_signal_exits_0_in_time_whatever_the_clients_do(tmp_path, sig, core):
    args = ["--num-blocks", "1024", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    srv = Server(tmp_path, *args, *(["--engine-in-process"] if core == "thread" else []))
    try:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", srv.port))
        # and never reads: the echoed prompt's logprobs (~3 MB at once) fill even autotuned socket buffers
        stalled.sendall(stream_body(prompt="a" * 1500, echo=True, n=4, logprobs=20, max_tokens=400))
        half = socket.create_connection(("127.0.0.1", srv.port))
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never completes its headers

        def reader() -> None:
            try:
                with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30,
                                  json={"prompt": "x", "max_tokens": 1500, "stream": True,
                                        "ignore_eos": True}) as r:
                    for _ in r.iter_lines():
                        pass
            except httpx.HTTPError:
                pass

        threading.Thread(target=reader, daemon=True).start()
        time.sleep(1.5)  # everyone is in flight; the stalled client's buffers are full
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
