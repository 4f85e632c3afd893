"""HTTP/1.0 requests as RFC 9110/9112 ask a server to answer them, where uvicorn's httptools cycle does not.

uvicorn sends a response without Content-Length chunked and answers `Expect: 100-continue` whatever the
request's version. To an HTTP/1.0 client neither may go (RFC 9112 §6.1: no Transfer-Encoding unless the
request is HTTP/1.1; RFC 9110 §15.2: no 1xx, and §10.1.1: its 100-continue is ignored): such a client reads a
body to the connection's end, so a stream's chunk sizes landed in its SSE text (a review). The connection
guard (connections.py) gives an HTTP/1.0 request's cycle this class; its body without Content-Length is
written as it is and ends with the connection (uvicorn closes an HTTP/1.0 connection after its answer).
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class CloseDelimitedCycle(RequestResponseCycle):
    """A response without Content-Length goes out as its bytes, delimited by the connection's close."""

    close_delimited = False

    async def send(self, message) -> None:  # type: ignore[override]
        if message["type"] == "http.response.start" and not self.response_started:
            if not any(name.lower() == b"content-length" for name, _ in message.get("headers", ())):
                self.close_delimited = True
                self.chunked_encoding = False  # uvicorn writes no transfer-encoding header then
            return await super().send(message)
        if not self.close_delimited or self.response_complete or message["type"] != "http.response.body":
            return await super().send(message)
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if self.scope["method"] != "HEAD":
            self.transport.write(message.get("body", b""))
        if not message.get("more_body", False):
            self.response_complete = True
            self.message_event.set()
            self.transport.close()
            self.on_response()
