"""Request body size limit: 413 from Content-Length up front, or as soon as a streamed body passes it."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError, error_response

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~250k tokens of prompt text


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        valid = declared is not None and declared.isascii() and declared.isdigit()  # "²".isdigit() too
        if declared is not None and (not valid or int(declared) > self.max_body_bytes):
            err = (BodyTooLarge(self.max_body_bytes) if valid
                   else APIError(400, "Invalid Content-Length header."))
            await error_response(err)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        await self.app(scope, limited_receive, send)
