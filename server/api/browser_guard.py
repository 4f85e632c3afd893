"""What a page on another site can make a browser send to this server, refused before any work.

CORS (cors.py) only stops a page from reading answers, and only where the browser sees another origin. Two
ways around it reached a server on the user's own machine (a hostile review):
- **DNS rebinding**: a site's own name made to resolve to 127.0.0.1 is same-origin with itself, so its page
  reads every answer. A server listening on loopback alone (the default, 127.0.0.1) therefore answers only
  requests whose Host names loopback (`localhost`, `127.0.0.1`, `::1`, any port) or a name --allowed-hosts
  adds (a reverse proxy on the same machine that passes on its public Host; "*": any), as Jupyter guards
  its loopback server; one listening on other interfaces is reached by names it cannot list, and takes any.
- **Simple cross-site requests**: a page's `fetch(url, {method: "POST", mode: "no-cors", body})` goes out
  without a preflight (text/plain), and the body is read as JSON (parsing.py), so it ran completions. A
  request that changes something (not GET, HEAD or OPTIONS) whose `Origin` is neither this server's own (the
  playground's: its Host, or the X-Forwarded-Host a proxy passes on) nor one --allowed-origins names is
  refused. Clients outside browsers (curl, SDKs) send no Origin and are not concerned.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.errors import APIError, error_response
from server.api.host_header import HOST_PROBLEM

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def listens_on_loopback_only(host: str) -> bool:
    """Whether `--host` binds loopback alone ("" and 0.0.0.0 / :: are every interface)."""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def host_name(authority: str) -> str:
    """A Host header's name without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "::1"."""
    return (urlsplit(f"//{authority}").hostname or "").lower()


class BrowserGuardMiddleware:
    """400 for a Host that is neither loopback nor in `allowed_hosts` where `loopback_only`; 403 for a
    cross-site request that changes something from an origin CORS does not allow (`allowed_origins`:
    --allowed-origins, "*" any)."""

    def __init__(self, app: ASGIApp, loopback_only: bool, allowed_origins: tuple[str, ...] = (),
                 allowed_hosts: tuple[str, ...] = ()):
        self.app = app
        self.loopback_only = loopback_only and "*" not in allowed_hosts
        self.hosts = LOOPBACK_HOSTS | {h.lower() for h in allowed_hosts}
        self.any_origin = "*" in allowed_origins
        self.allowed_origins = frozenset(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            err = self._refusal(scope)
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        problem = scope.get(HOST_PROBLEM)
        if problem is not None:  # RFC 9112 §3.2: several Host lines or an invalid one, whatever the address
            return APIError(400, problem, code="invalid_host")
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if self.loopback_only and host_name(host) not in self.hosts:
            return APIError(400, f"This server listens on loopback and answers requests for localhost, not "
                                 f"for host {host!r}: name it with --allowed-hosts (behind a proxy).",
                            code="invalid_host")
        origin = headers.get("origin")
        if origin is None or scope["method"] in SAFE_METHODS or self.any_origin:
            return None
        own = {host.lower(), headers.get("x-forwarded-host", host).lower()}
        netloc = urlsplit(origin).netloc.lower()  # "" for the opaque origin "null"
        if origin in self.allowed_origins or (netloc and netloc in own):
            return None
        return APIError(403, f"Requests from the page at {origin!r} are not allowed: --allowed-origins "
                             "names the origins a browser may call this server from.", code="cross_origin")
