"""Request ids: the one a client names its request by (vLLM's `request_id` body field, or its X-Request-Id
header), the response `id` formed from it, the engine's own id for it, and the X-Request-Id header every
response carries.

- The request id of /v1/completions and /v1/chat/completions is the body's `request_id`, else the client's
  X-Request-Id header, else a fresh uuid4 hex (vLLM's random_uuid). The response's `id` (unary, and every
  streamed chunk) is "cmpl-" / "chatcmpl-" + it, as vLLM's.
- A client id is 1 to MAX_REQUEST_ID_CHARS visible ASCII characters (no space, no control character):
  it goes back in a header, into logs and into every engine message, so it is bounded and header-safe.
- The engine's id is the response id + "-" + 16 random hex digits (vLLM's suffix): the logs that name an
  engine request name the client's id, and two requests in flight under the same client id are two engine
  requests, both served (vLLM serves them too since it suffixes the ids).
- Every response carries X-Request-Id: the client's own header when it sent a valid one (so a proxy that
  set it sees it come back unchanged), else the request id the handler resolved, else a fresh one.
"""

from __future__ import annotations

import re
import secrets
import uuid

from fastapi import Request
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError

HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 256
RULE = f"1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters (no spaces or control characters)"
_VALID = re.compile(rf"[!-~]{{1,{MAX_REQUEST_ID_CHARS}}}")
_STATE_KEY = "request_id"  # request.state's: the id the handler resolved, for the header and the logs


def check_request_id(value: str | None) -> str | None:
    """The body field's validator: ValueError (a 400 naming `request_id`) unless None or valid."""
    if value is not None and not _VALID.fullmatch(value):
        raise ValueError(f"must be {RULE}")
    return value


def new_request_id() -> str:
    return uuid.uuid4().hex


def client_header(headers: Headers) -> str | None:
    """The client's X-Request-Id if it sent exactly one valid value, else None."""
    values = headers.getlist(HEADER)
    return values[0] if len(values) == 1 and _VALID.fullmatch(values[0]) else None


def resolve_request_id(request: Request, body_id: str | None) -> str:
    """The request id of a completion request: the body's (validated already), else the header's, else a
    fresh one; a header that is sent but not one valid value is a 400 naming it. Kept in request.state for
    the response header and the logs."""
    values = request.headers.getlist(HEADER)
    if values and client_header(request.headers) is None:
        raise APIError(400, f"Invalid value for '{HEADER}' header: send one value of {RULE}.", HEADER,
                       "invalid_value")
    rid = body_id or (values[0] if values else new_request_id())
    request.scope.setdefault("state", {})[_STATE_KEY] = rid  # what request.state holds
    return rid


def engine_request_id(response_id: str) -> str:
    """The id the engine knows a request by: unique among live requests whatever ids clients send."""
    return f"{response_id}-{secrets.token_hex(8)}"


def request_id_of(scope: Scope) -> str | None:
    """For log lines: the id the handler resolved, else the client's header, else None."""
    return scope.get("state", {}).get(_STATE_KEY) or client_header(Headers(scope=scope))


class RequestIdMiddleware:
    """Adds X-Request-Id to every HTTP response (errors of the middlewares inside it included). Only the
    response's start message is changed: a stream's events pass through one more call each."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # shared with request.state by reference
        sent = client_header(Headers(scope=scope))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                rid = sent or state.get(_STATE_KEY) or new_request_id()
                MutableHeaders(scope=message).append(HEADER, rid)
            await send(message)

        await self.app(scope, receive, send_with_id)
