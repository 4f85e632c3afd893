"""Connection-level guards: uvicorn's httptools protocol plus the limits uvicorn does not have.

uvicorn (0.3x) times out idle keep-alive connections (`timeout_keep_alive`) but has no deadline for reading
a request's headers, no cap on open connections (`limit_concurrency` answers 503 to new *requests* and keeps
every connection open), no bound on the size of a request's headers with httptools, answers its own protocol
errors with a plain-text 400, and keeps a connection whose client stopped reading a response for as long as
the response lasts. GuardedHttpProtocol adds, per connection:
- a header deadline: a request's headers must be complete `header_timeout_s` after its first byte (or after
  the connection opened); otherwise the connection gets a 408 and is closed (slowloris);
- a header size bound: a request line plus headers over MAX_HEADER_BYTES get a 431 and the connection is
  closed (what h11 bounds by itself; llhttp hands uvicorn every fragment);
- a body deadline: once it runs (at once, or when its turn comes behind pipelined answers), a request's body
  must be complete within `header_timeout_s` plus its length (a chunked body: the server's body limit) at
  MIN_BODY_RATE; otherwise a 408 and the connection is closed (a body that trickles in would otherwise hold
  a connection slot forever);
- one valid Host line (host_header.py: 400 otherwise), an absolute-form target's authority as the Host the
  app sees, and HTTP/1.0 answered as that version asks (http10.py: no 100 Continue, no chunked body);
- a cap: a connection over `max_connections` open ones gets a 503 and is closed at once;
- a write-stall deadline: a client that reads nothing of a response for `stall_timeout_s` (the socket's send
  buffer, capped at SEND_BUFFER_BYTES, stays full) is disconnected; the app sees the disconnect, which aborts
  its engine requests and frees their KV blocks. While the buffer is full the response's sender waits, so what
  a stream holds is bounded by the time it may stall;
- a pipelining bound: a connection reads no further while requests wait behind the one being answered (uvicorn
  read on after every response, and one client's pipelined /health requests grew the process by 75 MB/s: a
  review), and one that queues over MAX_PIPELINED is closed. While it reads nothing, its socket is polled for
  the client's hang-up every EOF_POLL_S, and the request being answered sees the disconnect (uvicorn neither
  reads the FIN then nor tells the running request, whose cycle a pipelined one replaced: a review found a
  gone client's non-streamed request running to max_tokens);
- at shutdown, a connection whose client is not reading is disconnected at once (before the engine drains,
  and again when uvicorn closes connections), so a stalled client cannot hold the exit;
- the OpenAI error body on every answer it writes itself (400, 408, 414, 431, 503).

httptools (llhttp) rather than h11: the API process streams every token of every stream through this
protocol, and its per-event cost is most of the API process's time at high concurrency (tools/api_bench,
docs/benchmarks/api_cpu.md: -11% CPU per SSE event against the h11 protocol).
"""

from __future__ import annotations

import asyncio
import json
import logging
import select
import socket

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.api.errors import error_body
from server.api.host_header import HOST_PROBLEM, host_problem, target_authority
from server.api.http10 import CloseDelimitedCycle
from server.api.limits import DEFAULT_MAX_BODY_BYTES
from server.api.request_ids import HEADER, new_request_id

logger = logging.getLogger("pagewalk.api")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_STALL_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5
MAX_HEADER_BYTES = 64 * 1024  # request line + headers; h11's default bound is 16 KiB, nginx's 8-32 KiB
MIN_BODY_RATE = 64 * 1024  # bytes/s a request body must average after its headers (a 1 MiB body: 16 s more)
# the kernel's share of what a connection may hold unsent (Linux doubles it); autotuning would let a
# client that reads nothing absorb up to tcp_wmem's maximum (megabytes) before the stall deadline starts.
# A token stream needs a small fraction of this per round trip.
SEND_BUFFER_BYTES = 256 * 1024
MAX_PIPELINED = 16  # requests queued on one connection behind the one being answered (browsers send none)
EOF_POLL_S = 0.25  # how often a connection that reads nothing (requests pipelined) is checked for a hang-up
# the peer's FIN with data still unread (Linux); POLLHUP and POLLERR (a reset) are reported regardless
_HANG_UP = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


def raw_error(status: int, reason: str, message: str, code: str | None = None) -> bytes:
    """A complete HTTP/1.1 error response (Connection: close) with the OpenAI error body."""
    body = json.dumps(error_body(status, message, None, code)).encode()
    # a fresh X-Request-Id, as every response carries one (the request's own headers are not read here)
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{HEADER.lower()}: {new_request_id()}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode() + body


class HeadersTooLarge(Exception):
    """A request's line and headers passed MAX_HEADER_BYTES (raised from a parser callback)."""


class PipelineTooDeep(Exception):
    """A request began with MAX_PIPELINED queued ahead of it (raised from a parser callback)."""


class GuardedHttpProtocol(HttpToolsProtocol):
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    stall_timeout_s = DEFAULT_STALL_TIMEOUT_S
    max_connections = DEFAULT_MAX_CONNECTIONS
    max_body_bytes = DEFAULT_MAX_BODY_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.header_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.stall_timer: asyncio.TimerHandle | None = None
        self.eof_timer: asyncio.TimerHandle | None = None  # polls for a hang-up while requests are pipelined
        self.running_cycle = None  # the request being answered (uvicorn's self.cycle is the last one read)
        self.paused_since: float | None = None  # loop time its writes paused (a full socket buffer)
        self.awaiting_headers = True  # the next request's headers are not complete yet
        self.header_bytes = 0  # of the request being read: its line and headers so far
        self.header_deadline = 0.0  # loop time the request being read must have its headers by
        self.pipeline_overflow = False
        self.body_length = 0  # of the last request whose headers were read
        self.awaiting_url = True  # the request being read has no header line yet (its target may be growing)
        self.deferred_error: bytes | None = None  # a parse error's answer, due once `deferred_after` is out
        self.deferred_after = None  # the cycle answered just ahead of the malformed request
        self.unsent_timer: asyncio.TimerHandle | None = None  # watches bytes left unsent after an answer
        self.unsent_bytes = 0
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        if len(self.connections) > self.max_connections:
            logger.warning("connection refused: %d open connections (max_connections=%d)",
                           len(self.connections) - 1, self.max_connections)
            transport.write(raw_error(503, "Service Unavailable", "Too many open connections; retry later.",
                                      "too_many_connections"))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        running = self.running_cycle
        super().connection_lost(exc)  # tells self.cycle alone: a pipelined request's, not the running one's
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True
            running.message_event.set()

    def _start_asgi_task(self, cycle, app) -> None:
        self.running_cycle = cycle
        super()._start_asgi_task(cycle, app)
        if self.body_length and cycle.more_body and cycle.scope is self.scope and self.body_timer is None:
            # the body deadline runs from the request's start: a request queued behind an answer may have its
            # body held back by its client until then (Expect: 100-continue), and a deadline armed with its
            # headers wrote a 408 into the answer ahead of it (a review). (body_length: the last request
            # read's, this one's; one with more queued behind it has its body whole.)
            self.body_timer = self.loop.call_later(self.header_timeout_s + self.body_length / MIN_BODY_RATE,
                                                   self._body_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.pipeline and self.eof_timer is None:  # uvicorn reads no further: the FIN would go unread
            self.eof_timer = self.loop.call_later(EOF_POLL_S, self._watch_hang_up)
        if (self.header_timer is None and self.body_timer is None and not self.pipeline
                and (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing()):
            # bytes that began no request (llhttp skips the CRLFs between requests) cancelled uvicorn's
            # keep-alive timer: the next request's header deadline runs from them (one bare CRLF after a
            # response held a connection slot forever: a review)
            self.awaiting_headers, self.header_bytes = True, 0
            self._arm_header_timer()

    # ---- parser callbacks: the header deadline and size bound -----------------------------------
    def on_message_begin(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            self.pipeline_overflow = True
            raise PipelineTooDeep
        super().on_message_begin()
        self.awaiting_headers, self.header_bytes, self.awaiting_url = True, 0, True
        self._arm_header_timer()  # from the request's first byte

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.awaiting_url = False
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.awaiting_headers = False
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        version = self.parser.get_http_version()
        problem = host_problem([v for n, v in self.headers if n == b"host"], version)
        authority = target_authority(self.url)
        if authority is not None and problem is None:  # RFC 9112 §3.2.2: the target's authority is the host
            problem = host_problem([authority], version)
            self.headers[:] = [(n, v) for n, v in self.headers if n != b"host"] + [(b"host", authority)]
        if problem is not None:  # answered by the browser guard, in its turn behind answers pipelined ahead
            self.scope[HOST_PROBLEM] = problem
        http10 = version == "1.0"
        if http10:
            self.expect_100_continue = False  # RFC 9110 §10.1.1: ignored in an HTTP/1.0 request (http10.py)
        self.body_length = _body_length(self.headers, self.max_body_bytes)
        super().on_headers_complete()  # (starts the request at once, or queues it: _start_asgi_task)
        if http10 and self.cycle is not None and self.cycle.scope is self.scope:
            self.cycle.__class__ = CloseDelimitedCycle

    def on_message_complete(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        super().on_message_complete()

    def _count_header_bytes(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > MAX_HEADER_BYTES:
            # the parser turns a callback's exception into a parse error: uvicorn stops feeding it and
            # calls send_400_response, which answers 431 for this one
            raise HeadersTooLarge

    def on_response_complete(self) -> None:
        if self.deferred_error is not None and self.deferred_after.response_complete \
                and not self.transport.is_closing():
            self.transport.write(self.deferred_error)  # a malformed request's answer, after those ahead of it
            self.transport.close()
        super().on_response_complete()  # starts the next queued request, and reads on (not once closing)
        self._watch_unsent()
        if self.transport.is_closing():
            return
        if self.pipeline:
            self.flow.pause_reading()  # not while requests still wait: what one connection queues is bounded
        elif self.awaiting_headers and self.header_timer is None:
            # a request's headers began while this response was written: its deadline, from its first byte
            self.header_timer = self.loop.call_at(self.header_deadline, self._header_timeout)

    def send_400_response(self, msg: str) -> None:
        if self.pipeline_overflow:  # (answers queued ahead of it own the wire: no answer can come first)
            logger.info("closing a connection from %s: over %d pipelined requests", _peer(self),
                        MAX_PIPELINED)
            self.transport.close()
            return
        if self.deferred_error is not None or self.transport.is_closing():
            return  # said already (the parser repeats its error on every later read)
        if self.header_bytes > MAX_HEADER_BYTES and self.awaiting_url:  # RFC 9112 §3: the target's own status
            logger.info("closing a connection from %s: request target over %d bytes", _peer(self),
                        MAX_HEADER_BYTES)
            error = raw_error(414, "URI Too Long", f"The request target exceeds {MAX_HEADER_BYTES} bytes.",
                              "uri_too_long")
        elif self.header_bytes > MAX_HEADER_BYTES:
            logger.info("closing a connection from %s: request line and headers over %d bytes", _peer(self),
                        MAX_HEADER_BYTES)
            error = raw_error(431, "Request Header Fields Too Large",
                              f"Request line and headers exceed {MAX_HEADER_BYTES} bytes.",
                              "headers_too_large")
        else:
            error = raw_error(400, "Bad Request", f"{msg} (malformed HTTP)", "invalid_http")
        ahead = self._answer_ahead()
        if ahead is not None and not ahead.response_complete:  # the answers ahead of it go out first, whole
            # (RFC 9112 §9.3.2: request order; written at once it landed inside the stream being sent: a
            # review)
            self.deferred_error, self.deferred_after = error, ahead
            self.flow.pause_reading()
            return
        self.transport.write(error)
        self.transport.close()
        self._watch_unsent()

    def _answer_ahead(self):
        """The cycle answered just before the malformed request: the last one read if the error is in a new
        request's head; if in the body of the last one read, the one queued or running ahead of it (None
        when it runs itself: its answer is the error)."""
        if self.awaiting_headers:
            return self.cycle
        queued = [cycle for cycle, _ in self.pipeline]  # newest first (uvicorn appends left)
        if queued and queued[0] is self.cycle:
            return queued[1] if len(queued) > 1 else self.running_cycle
        return None

    # ---- deadlines --------------------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_deadline = self.loop.time() + self.header_timeout_s
            self.header_timer = self.loop.call_at(self.header_deadline, self._header_timeout)

    def _header_timeout(self) -> None:
        self.header_timer = None
        if not self.awaiting_headers or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # a response is still being written (pipelined bytes wait for it): on_response_complete arms
            # the timer again, at once if the deadline has passed (a review: nothing did, and a connection
            # trickling pipelined headers stayed open)
            return
        logger.info("closing a connection from %s: headers not complete in %.0f s", _peer(self),
                    self.header_timeout_s)
        self.transport.write(raw_error(408, "Request Timeout", "Request headers not received in time.",
                                       "request_timeout"))
        self.transport.close()

    def _watch_hang_up(self) -> None:
        self.eof_timer = None
        if not self.pipeline or self.transport.is_closing():
            return  # reading again: the FIN reaches uvicorn (or the connection is already going)
        sock = self.transport.get_extra_info("socket")
        poller = select.poll()
        poller.register(sock.fileno(), _HANG_UP)
        if poller.poll(0):
            logger.info("closing a connection from %s: it hung up with requests pipelined", _peer(self))
            self.transport.abort()  # connection_lost tells the running request
            return
        self.eof_timer = self.loop.call_later(EOF_POLL_S, self._watch_hang_up)

    def _body_timeout(self) -> None:
        self.body_timer = None
        if self.transport.is_closing():
            return
        logger.info("closing a connection from %s: request body not received in time", _peer(self))
        running = self.running_cycle
        if running is None or not running.response_started:
            self.transport.write(raw_error(408, "Request Timeout", "Request body not received in time.",
                                           "request_timeout"))
        self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.paused_since is None:
            self.paused_since = self.loop.time()
        if self.stall_timer is None:
            self.stall_timer = self.loop.call_later(self.stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self.paused_since = None
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None

    def _watch_unsent(self) -> None:
        """After an answer, bytes the client has not read may stay in the transport's buffer below the level
        that pauses writing (64 KiB): no stall timer runs then, and a close (keep-alive's, an error's)
        waits for a drain that never comes (a review: connections held open a minute on). If none of them
        leaves within the stall timeout, the connection is aborted."""
        size = self.transport.get_write_buffer_size()
        if self.unsent_timer is None and size:
            self.unsent_bytes = size
            self.unsent_timer = self.loop.call_later(self.stall_timeout_s, self._unsent_check)

    def _unsent_check(self) -> None:
        self.unsent_timer = None
        size = self.transport.get_write_buffer_size()
        if not size or self.flow.write_paused:  # drained, or the stall timer watches now
            return
        if size < self.unsent_bytes:  # the client reads on, slowly
            self._watch_unsent()
            return
        self._stalled()

    def _stalled(self) -> None:
        self.stall_timer = None
        logger.info("disconnecting %s: it read nothing for %.0f s (its requests are aborted)", _peer(self),
                    self.stall_timeout_s)
        self.transport.abort()  # close() would wait for the full buffer to drain

    def drop_if_stalled(self, paused_at_least_s: float = 0.0) -> bool:
        """Abort the connection if its writes have been paused for `paused_at_least_s` (0: at all)."""
        if self.flow is None or not self.flow.write_paused or self.transport.is_closing():
            return False
        if self.paused_since is not None and self.loop.time() - self.paused_since < paused_at_least_s:
            return False  # a reader whose buffer is full for a moment, not one that stopped
        logger.info("disconnecting %s at shutdown: it is not reading its response", _peer(self))
        self.transport.abort()
        return True

    def shutdown(self) -> None:
        """uvicorn closes the connections: the drain is over. A request whose body is still arriving would
        keep its handler waiting past uvicorn's graceful timeout, which cancels it with a traceback and
        drops the connection unanswered (a review): it gets the drain's 503 and its handler a disconnect."""
        if self.drop_if_stalled():
            return
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_started:
            super().shutdown()
            return
        logger.info("closing a connection from %s at shutdown: its request body was still arriving",
                    _peer(self))
        self.transport.write(raw_error(503, "Service Unavailable", "The server is shutting down.",
                                       "shutting_down"))
        cycle.disconnected = True  # the handler's receive() now answers http.disconnect
        cycle.message_event.set()
        self._cancel_timers()
        self.transport.close()

    def _cancel_timers(self) -> None:
        timers = (self.header_timer, self.body_timer, self.stall_timer, self.eof_timer, self.unsent_timer)
        for timer in timers:
            if timer is not None:
                timer.cancel()
        self.header_timer = self.body_timer = self.stall_timer = self.eof_timer = self.unsent_timer = None


SHUTDOWN_STALL_S = 1.0  # paused this long when the drain starts: a client that stopped reading


def drop_stalled(connections) -> None:
    """At shutdown, before the engine drains: a client not reading would only hold the drain. One whose
    socket buffer is full for a moment (a fast reader behind a burst) keeps its stream to the end; a stall
    that starts later meets the stall deadline, and the drain its --shutdown-timeout."""
    for connection in list(connections):
        if isinstance(connection, GuardedHttpProtocol):
            connection.drop_if_stalled(SHUTDOWN_STALL_S)


def _body_length(headers: list[tuple[bytes, bytes]], max_body_bytes: int) -> int:
    """The body length a request's headers announce, at most `max_body_bytes` (a longer one gets a 413
    from the app at once); a chunked body counts as `max_body_bytes`, no body as 0."""
    for name, value in headers:
        if name == b"content-length":
            return min(int(value), max_body_bytes) if value.strip().isdigit() else 0  # bad: the parser's
        if name == b"transfer-encoding" and b"chunked" in value.lower():
            return max_body_bytes
    return 0


def _peer(protocol: HttpToolsProtocol) -> str:
    return f"{protocol.client[0]}:{protocol.client[1]}" if protocol.client else "a client"


def guarded_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                     stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                     max_connections: int = DEFAULT_MAX_CONNECTIONS,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> type[GuardedHttpProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these settings."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {
        "header_timeout_s": header_timeout_s, "stall_timeout_s": stall_timeout_s,
        "max_connections": max_connections, "max_body_bytes": max_body_bytes})
