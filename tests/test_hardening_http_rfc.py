"""HTTP/1.x as RFC 9110/9112 ask a server to answer it, against a real `pagewalk serve` (raw sockets): an
HTTP/1.0 client's stream is not chunked and gets no 100 Continue (server/api/http10.py), a pipelined
request's body deadline runs from its start, one valid Host line (server/api/host_header.py). Each case
failed before a review's fixes."""

from __future__ import annotations

import json
import re

import pytest
from server_helpers import Server, connect, read_all

from server.api.host_header import host_problem, target_authority

pytestmark = pytest.mark.timeout(180)

HEADER_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("http1"), "--header-timeout", str(HEADER_TIMEOUT_S))
    yield srv
    srv.stop()


def post(path: bytes, body: dict, version: bytes = b"HTTP/1.1", extra: bytes = b"") -> tuple[bytes, bytes]:
    """A POST's head (through the blank line) and its body, apart."""
    data = json.dumps(body).encode()
    head = (b"POST " + path + b" " + version + b"\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: %d\r\n\r\n" % len(data))
    return head, data


def response_head(raw: bytes) -> bytes:
    return raw.partition(b"\r\n\r\n")[0].lower()


# ---- 1. A streamed answer to an HTTP/1.0 request is chunked ----------------------------------------------
def test_stream_to_http10_client_is_not_chunked(server):
    """RFC 9112 §6.1: a server MUST NOT send Transfer-Encoding unless the request is HTTP/1.1 or later; an
    HTTP/1.0 client reads the body to EOF, so the chunk sizes ("d0\\r\\n") land in its SSE text."""
    head, body = post(b"/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True},
                      version=b"HTTP/1.0")
    s = connect(server, timeout=20)
    s.sendall(head + body)
    raw = read_all(s)
    s.close()
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    assert b"transfer-encoding" not in response_head(raw), response_head(raw)
    assert raw.partition(b"\r\n\r\n")[2].startswith(b"data: "), raw[:400]  # close-delimited SSE: no sizes


# ---- 2. 100 Continue to an HTTP/1.0 request --------------------------------------------------------------
def test_no_100_continue_to_http10_client(server):
    """RFC 9110 §15.2: a server MUST NOT send a 1xx response to an HTTP/1.0 client; §10.1.1: a 100-continue
    expectation in an HTTP/1.0 request MUST be ignored."""
    head, body = post(b"/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3},
                      version=b"HTTP/1.0", extra=b"Expect: 100-continue\r\n")
    s = connect(server, timeout=1.0)
    s.sendall(head)
    try:
        early = s.recv(65536)  # nothing should come before the body is sent
    except TimeoutError:
        early = b""
    s.settimeout(20)
    s.sendall(body)
    raw = early + read_all(s)
    s.close()
    assert not raw.startswith(b"HTTP/1.1 100"), raw[:100]
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]


# ---- 3. A pipelined request's body deadline runs while the server itself is not reading it ---------------
@pytest.mark.parametrize("stream", [True, False])
def test_pipelined_expect_request_does_not_cut_the_answer_ahead(server, stream):
    """A request pipelined behind a long one, with `Expect: 100-continue`, cannot send its body before the
    server's 100 Continue, which comes only when it starts. Its body deadline (armed at its headers,
    connections.py on_headers_complete) fires meanwhile and `_body_timeout` writes a raw 408 into the
    connection while the first request's answer is still being written (`self.cycle` is the pipelined
    request's cycle, not the running one): the stream ahead is corrupted mid-chunk and cut, or (not
    streamed) the 408 arrives as the answer to the first request. RFC 9112 §9.3.2: responses in request
    order; README: the body deadline runs from a request's headers, here the server held the body back."""
    long_req = {"model": "tiny", "prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": stream}
    h1, b1 = post(b"/v1/completions", long_req)
    h2, b2 = post(b"/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3},
                  extra=b"Expect: 100-continue\r\nConnection: close\r\n")
    s = connect(server, timeout=60)
    s.sendall(h1 + b1 + h2)
    raw, sent_body = b"", False
    while chunk := s.recv(65536):
        raw += chunk
        if not sent_body and b"HTTP/1.1 100 Continue\r\n\r\n" in raw:
            s.sendall(b2)
            sent_body = True
    s.close()
    statuses = [line for line in raw.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    assert b"HTTP/1.1 408" not in raw, statuses
    assert statuses[0] == b"HTTP/1.1 200 OK", statuses
    if stream:
        assert b"data: [DONE]" in raw
    assert sent_body and statuses[-1] == b"HTTP/1.1 200 OK", statuses


# ---- 5. Several Host lines, or an invalid Host, are not a 400 ----------------------------------------------
@pytest.mark.parametrize("host_lines", [
    b"Host: localhost\r\nHost: evil.example\r\n",  # the guard reads the first; a proxy may route on the last
    b"Host: localhost:abc\r\n",
    b"Host: evil.example@localhost\r\n",
    b"Host: localhost/evil\r\n",
])
def test_duplicate_or_invalid_host_is_400(server, host_lines):
    """RFC 9112 §3.2: a server MUST respond 400 to any request message that contains more than one Host
    header field line or a Host header field with an invalid field value (uri-host [":" port])."""
    s = connect(server, timeout=20)
    s.sendall(b"GET /health HTTP/1.1\r\n" + host_lines + b"Connection: close\r\n\r\n")
    raw = read_all(s)
    s.close()
    assert raw.startswith(b"HTTP/1.1 400"), raw[:200]


# ---- 6. absolute-form: the Host header was used instead of the target's authority ------------------
@pytest.mark.parametrize("target,host,status", [
    (b"http://evil.example/health", b"localhost", b"400"),  # the request is for evil.example
    (b"http://localhost/health", b"evil.example", b"200"),  # the request is for localhost
])
def test_absolute_form_target_authority_wins_over_host(server, target, host, status):
    """RFC 9112 §3.2.2: an origin server that receives an absolute-form request-target MUST ignore the Host
    header field and use the target's host; the loopback guard (browser_guard.py) reads the Host header."""
    s = connect(server, timeout=20)
    s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
    raw = read_all(s)
    s.close()
    assert raw.startswith(b"HTTP/1.1 " + status), raw[:300]


@pytest.mark.parametrize("hosts,version,ok", [
    ([b"localhost"], "1.1", True), ([b"127.0.0.1:8000"], "1.1", True), ([b"[::1]:80"], "1.1", True),
    ([b""], "1.1", True), ([], "1.0", True), ([], "1.1", False), ([b"a", b"a"], "1.1", False),
    ([b"localhost:80a"], "1.1", False), ([b"u@localhost"], "1.1", False), ([b"localhost/x"], "1.1", False),
    ([b"local host"], "1.1", False)])
def test_host_problem(hosts, version, ok):
    assert (host_problem(hosts, version) is None) == ok


def test_target_authority():
    assert target_authority(b"http://evil.example:81/health?x") == b"evil.example:81"
    assert target_authority(b"/health") is None and target_authority(b"*") is None


def long_post(stream: bool) -> bytes:
    data = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 300, "ignore_eos": True,
                       "stream": stream}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(data)) + data


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("second,status", [
    (b"GET /health HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\nConnection: close\r\n\r\n", b"400"),
    (b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", b"431")])
def test_a_bad_request_pipelined_behind_an_answer_is_answered_after_it(server, stream, second, status):
    """RFC 9112 §9.3.2: answers in request order. A bad Host's 400 and an oversized head's 431, written at
    once, landed inside the stream ahead or stood first on the wire (a review)."""
    s = connect(server, timeout=30)
    s.sendall(long_post(stream))
    first = s.recv(65536) if stream else b""  # the stream has begun
    s.sendall(second)
    raw = first + read_all(s)
    s.close()
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)  # (a non-streamed body ends with no line break)
    assert statuses == [b"200", status], statuses
    if stream:
        assert raw.index(b"data: [DONE]") < raw.index(b"HTTP/1.1 " + status)


def test_an_absolute_form_authority_is_checked_as_a_host_line_is():
    assert host_problem([target_authority(b"http://evil.example@localhost/health")], "1.1") is not None


def test_a_malformed_body_of_the_running_request_is_answered_400_at_once(server):
    """Its own unanswered request counted as an answer ahead: the 400 waited, and the body deadline answered
    408 seconds later (a review of the deferral)."""
    s = connect(server, timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\nzz\r\n")
    raw = read_all(s)
    s.close()
    assert raw.startswith(b"HTTP/1.1 400 ") and b"invalid_http" in raw, raw[:200]
