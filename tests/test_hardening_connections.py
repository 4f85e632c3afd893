"""Findings 2, 5, 6 and 9 of issue 17 against a real uvicorn (raw sockets): slowloris connections are closed
at the header deadline, connections over the cap get a 503, a client that stops reading is disconnected and
its request aborted, uvicorn's own 400 carries the OpenAI error body, a client gone mid-body is one info
line (no traceback), HEAD /health works."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import Server, connect, read_all

from server.api.connections import MAX_HEADER_BYTES, MAX_PIPELINED, MIN_BODY_RATE

pytestmark = pytest.mark.timeout(120)

HEADER_TIMEOUT_S = 1.5
STALL_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 12
MAX_BODY_BYTES = 32 * 1024  # a chunked body's deadline: HEADER_TIMEOUT_S + 0.5 s


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("conn"), "--num-blocks", "1024", "--header-timeout",
                 str(HEADER_TIMEOUT_S), "--client-stall-timeout", str(STALL_TIMEOUT_S),
                 "--max-connections", str(MAX_CONNECTIONS), "--max-body-bytes", str(MAX_BODY_BYTES))
    yield srv
    srv.stop()


def json_body(raw: bytes) -> dict:
    return json.loads(raw.partition(b"\r\n\r\n")[2])


def test_slowloris_connections_are_closed_at_the_header_deadline(server):
    socks = [connect(server) for _ in range(6)]
    start = time.monotonic()
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    deadline = start + HEADER_TIMEOUT_S + 3
    for i in range(40):  # a header line's byte every 0.1 s: never complete
        if time.monotonic() > HEADER_TIMEOUT_S + start + 0.5:
            break
        for s in socks:
            try:
                s.sendall(b"X" if i % 2 else b"-")
            except OSError:
                pass
        time.sleep(0.1)
    for s in socks:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        raw = read_all(s)  # an uncut connection raises TimeoutError here
        assert raw.startswith(b"HTTP/1.1 408"), raw
        assert json_body(raw)["error"]["code"] == "request_timeout"
        s.close()
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 2
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_connections_over_the_cap_get_503(server):
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.2)
    extra = connect(server)
    raw = read_all(extra)
    assert raw.startswith(b"HTTP/1.1 503") and json_body(raw)["error"]["code"] == "too_many_connections", raw
    for s in held + [extra]:
        s.close()
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_uvicorn_400_is_an_openai_error_body(server):
    s = connect(server)
    s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    raw = read_all(s)
    assert raw.startswith(b"HTTP/1.1 400"), raw
    err = json_body(raw)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_http"
    assert b"\r\nx-request-id: " in raw.split(b"\r\n\r\n")[0]  # as every response (a fresh one here)


@pytest.mark.parametrize("where", ["url", "one header", "many headers"])
def test_oversized_request_headers_get_431(server, where):
    """The request line and headers are bounded (MAX_HEADER_BYTES) however they are split; the server
    answers 431 with the OpenAI body (414 for an over-long target, RFC 9112 §3: 431 before a review), closes
    the connection, and keeps serving."""
    big = MAX_HEADER_BYTES + 1024
    if where == "url":
        head = b"GET /health?" + b"a" * big + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    elif where == "one header":
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * big + b"\r\n\r\n"
    else:
        head = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-H: aaaaaaaaaaaaaaaa\r\n" * (big // 20)
                + b"\r\n")
    s = connect(server)
    try:
        s.sendall(head)
    except OSError:  # closed while we were still sending
        pass
    raw = read_all(s)
    status, code = (b"414", "uri_too_long") if where == "url" else (b"431", "headers_too_large")
    assert raw.startswith(b"HTTP/1.1 " + status), raw[:200]
    assert json_body(raw)["error"]["code"] == code
    assert b"\r\nx-request-id: " in raw.split(b"\r\n\r\n")[0]
    s.close()
    assert httpx.get(f"{server.url}/health", headers={"X-Fine": "a" * 4096}).status_code == 200


def test_the_header_deadline_applies_to_each_request_of_a_keep_alive_connection(server):
    s = connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
        first += s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200"), first
    time.sleep(HEADER_TIMEOUT_S + 0.5)  # idle between requests: the keep-alive timeout's business
    start = time.monotonic()
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never completes its headers
    raw = read_all(s)
    assert raw.startswith(b"HTTP/1.1 408"), raw
    assert HEADER_TIMEOUT_S - 0.3 < time.monotonic() - start < HEADER_TIMEOUT_S + 2
    s.close()


def test_a_bare_crlf_after_a_response_starts_the_header_deadline(server):
    """llhttp skips the CRLFs between requests and uvicorn's keep-alive timer stops at any byte: one CRLF
    after a response held the connection (and its slot under --max-connections) forever (a review)."""
    s = connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
        first += s.recv(65536)
    start = time.monotonic()
    s.sendall(b"\r\n")
    raw = read_all(s)
    assert raw.startswith(b"HTTP/1.1 408"), raw
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 2
    s.close()


def until(check, limit_s: float) -> float:
    """Seconds until check() holds (inf past limit_s)."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    return float("inf")


def test_a_client_gone_with_a_request_pipelined_is_noticed(server):
    """uvicorn reads nothing while a request waits pipelined, so a client's FIN went unread, and its hang-up
    would not reach the running request anyway (a pipelined cycle replaced it): its non-streamed request ran
    to max_tokens, holding its row and blocks (a review). Now it is aborted within a second or so."""
    body = json.dumps({"prompt": "hello", "max_tokens": 1800, "temperature": 0, "ignore_eos": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body) + body)
    socks = [connect(server) for _ in range(3)]
    for s in socks:
        s.sendall(request + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert until(lambda: server.health()["running"] == 3, 20) < 20
    for s in socks:
        s.close()
    assert until(lambda: server.health()["running"] == 0, 10) < 3
    assert until(lambda: server.health()["kv_cache"]["used_blocks"] == 0, 10) < 10


def test_a_connection_queues_a_bounded_number_of_pipelined_requests(server):
    """4,000 pipelined requests in one write: the connection is answered a bounded number of them, then closed
    (uvicorn read on after every response, and such a client grew the process by 75 MB/s: a review); another
    client is served meanwhile and after."""
    s = connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 4000)
    raw = b""
    try:  # ends when the server closes the connection (a reset: it closed with requests unread)
        while chunk := s.recv(65536):
            raw += chunk
    except ConnectionResetError:
        pass
    s.close()
    assert raw.count(b"HTTP/1.1 200") <= MAX_PIPELINED + 2, raw.count(b"HTTP/1.1 200")
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_pipelined_headers_that_trickle_meet_the_header_deadline(server):
    """A request whose headers begin while the one before it streams, then trickle: closed at its deadline,
    counted from its first byte, once the response before it is written (a review: the deadline was dropped
    and the connection stayed open)."""
    s = connect(server)
    # a stream that outlasts the header deadline (hundreds of tokens of the tiny preset on a CPU)
    body = json.dumps({"prompt": "hi", "max_tokens": 600, "ignore_eos": True, "stream": True}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
    s.sendall(head + body + b"GET /health HTTP/1.1\r\nX-A: ")
    # read the stream as it comes: a client that reads nothing while the socket's buffers fill is dropped
    # after --client-stall-timeout (1 s here), which cut the stream in some runs
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read_all, s)
        start = time.monotonic()
        while time.monotonic() - start < 60 and not reading.done():  # a header byte every 0.5 s
            time.sleep(0.5)
            try:
                s.sendall(b"a")
            except OSError:
                break
        raw = reading.result(timeout=60)
    s.close()
    assert raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in raw, raw[:300]
    assert b"HTTP/1.1 408" in raw, raw[-300:]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_that_trickles_is_cut_at_its_deadline(server, framing):
    """Headers complete, then the body comes a byte every 0.2 s: the bytes do not extend the deadline
    (header timeout + length / MIN_BODY_RATE; a chunked body counts as the body limit), so the connection
    gets a 408 and is closed when it passes; the server keeps serving. The client stops sending just before
    the deadline (bytes sent to a closed socket would reset the connection and lose the 408)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if framing == "content-length":
        head += b"Content-Length: 1000\r\n\r\n{"
        limit, byte = HEADER_TIMEOUT_S + 1000 / MIN_BODY_RATE, b" "
    else:
        head += b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
        limit, byte = HEADER_TIMEOUT_S + MAX_BODY_BYTES / MIN_BODY_RATE, b"1\r\n \r\n"
    s = connect(server)
    start = time.monotonic()
    s.sendall(head)
    while time.monotonic() - start < limit - 0.4:
        s.sendall(byte)
        time.sleep(0.2)
    raw = read_all(s)
    elapsed = time.monotonic() - start
    assert raw.startswith(b"HTTP/1.1 408"), raw
    assert json_body(raw)["error"]["code"] == "request_timeout"
    assert limit - 0.3 < elapsed < limit + 2
    s.close()
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_head_health_is_200(server):
    r = httpx.head(f"{server.url}/health")
    assert r.status_code == 200 and r.content == b""


def test_client_gone_mid_body_is_one_info_line(server):
    before = server.log.read_text()
    s = connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"prompt\": \"he")
    time.sleep(0.2)
    s.close()
    time.sleep(0.5)
    new = server.log.read_text()[len(before):]
    assert "Traceback" not in new and "ERROR" not in new, new
    assert new.count("client went away") == 1, new


def test_a_client_that_stops_reading_is_disconnected_and_aborted(server):
    before = server.log.read_text()
    aborted = server.metric("pagewalk_request_success_total", {"finished_reason": "abort"})
    body = json.dumps({"prompt": "hi", "max_tokens": 1500, "n": 4, "logprobs": 20, "stream": True,
                       "ignore_eos": True}).encode()
    s = connect(server, rcvbuf=4096)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    # read nothing: the server's buffers fill, it waits STALL_TIMEOUT_S, then drops the connection
    deadline = time.monotonic() + 30
    while "read nothing" not in server.log.read_text()[len(before):]:
        assert time.monotonic() < deadline, server.log.read_text()[len(before):]
        time.sleep(0.1)
    server.wait_idle()  # the request is aborted in the engine and its blocks are free
    after = server.metric("pagewalk_request_success_total", {"finished_reason": "abort"})
    assert after - aborted == 4  # every choice aborted, none ran to its 1500 tokens
    new = server.log.read_text()[len(before):]
    assert "Traceback" not in new and new.count("read nothing") == 1, new
    s.close()


def test_the_shutdown_drop_spares_a_reader_whose_buffer_is_full_for_a_moment():
    """drop_stalled (SIGTERM, before the drain) aborts a connection whose writes have been paused for
    SHUTDOWN_STALL_S, not one paused just now: a fast reader behind a burst keeps its stream to the end."""
    from types import SimpleNamespace

    from server.api.connections import SHUTDOWN_STALL_S, GuardedHttpProtocol, drop_stalled

    def connection(paused_for: float):
        conn = GuardedHttpProtocol.__new__(GuardedHttpProtocol)
        aborted = []
        conn.flow = SimpleNamespace(write_paused=True)
        conn.transport = SimpleNamespace(is_closing=lambda: False, abort=lambda: aborted.append(True))
        conn.loop = SimpleNamespace(time=lambda: 100.0)
        conn.paused_since, conn.client = 100.0 - paused_for, None
        return conn, aborted

    (moment, moment_aborted), (stopped, stopped_aborted) = connection(0.05), connection(SHUTDOWN_STALL_S + 1)
    drop_stalled([moment, stopped])
    assert moment_aborted == [] and stopped_aborted == [True]
    assert moment.drop_if_stalled() and moment_aborted == [True]  # uvicorn closing: any pause is dropped


def _server_side_state(port: int, client_port: int) -> str:
    return subprocess.run(["ss", "-tnH", "state", "all", f"( sport = :{port} and dport = :{client_port} )"],
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_a_client_that_reads_nothing_is_dropped_below_the_pause_level(server):
    """Answers that overflow the kernel's buffers by less than asyncio's 64 KiB pause level never paused
    writing, so no stall timer ran; the keep-alive close (or a deferred error's) then waited for a drain
    forever (a review: connections held a minute on). Pipelines of 8-16 /metrics answers put some
    connection's leftover in that window."""
    socks = []
    for depth in range(8, 17):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client reads nothing
        s.connect(("127.0.0.1", server.port))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n" * depth + b"BAD\r\n\r\n")
        socks.append(s)
    time.sleep(STALL_TIMEOUT_S + 5 + 4)  # the stall timeout, keep-alive's 5 s, slack
    held = [state for s in socks if (state := _server_side_state(server.port, s.getsockname()[1]))
            .startswith("ESTAB")]
    for s in socks:
        s.close()
    assert not held, held
