"""A request's Host as RFC 9112 §3.2 has a server read it: exactly one Host line with a valid value, and an
absolute-form target's authority in its place.

uvicorn passes every Host line on and the target's authority nowhere, and the loopback guard
(browser_guard.py) reads the first Host line: a second one (which a proxy in front may read instead) or a
value such as "evil.example@localhost" passed it, and `GET http://evil.example/ HTTP/1.1` with `Host:
localhost` was answered as localhost's (a review). The connection guard (connections.py) gives the app the
target's authority as Host and puts what `host_problem` names in the request's scope; the browser guard
answers it with a 400 before any work, in the request's turn (behind answers pipelined ahead of it).
"""

from __future__ import annotations

import re

HOST_PROBLEM = "pagewalk.host_problem"  # the scope's key for host_problem's answer (the browser guard's)

# RFC 3986 authority without userinfo: an IP literal or a reg-name (IPv4 included), then an optional port
_HOST = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(:[0-9]*)?")
_ABSOLUTE = re.compile(rb"[A-Za-z][A-Za-z0-9+.\-]*://([^/?#]*)")


def target_authority(url: bytes) -> bytes | None:
    """The authority of an absolute-form request target ("http://host:port/path"); None for origin-form."""
    m = _ABSOLUTE.match(url)
    return m.group(1) if m else None


def host_problem(hosts: list[bytes], http_version: str) -> str | None:
    """What is wrong with a request's Host lines (their values, in order), or None."""
    if len(hosts) > 1:
        return "A request carries one Host header; this one has several."
    if not hosts:
        return None if http_version == "1.0" else "An HTTP/1.1 request needs a Host header."
    if _HOST.fullmatch(hosts[0]) is None:
        return "The Host header is no valid host[:port]."
    return None
