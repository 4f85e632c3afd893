"""Server-sent events: `data: {json}\\n\\n` chunks ending with `data: [DONE]\\n\\n`."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request, Response
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.api.admission import Reservation, rejected_to_api_error
from server.api.async_engine import RequestRejected
from server.api.disconnects import ClientDisconnected, unless_disconnected
from server.api.engine_stream import RunningUsage
from server.api.errors import APIError, error_body
from server.api.protocol import dump
from server.api.request_ids import request_id_of
from server.api.request_work import run_in_worker

logger = logging.getLogger("pagewalk.api")

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # what json.dumps builds per call


def json_text(data) -> str:
    """Compact JSON, non-ASCII kept: the encoding of every SSE payload (= json.dumps with these options)."""
    return _ENCODER.encode(data)


def sse_event(payload: BaseModel | dict) -> str:
    data = dump(payload) if isinstance(payload, BaseModel) else payload
    return f"data: {json_text(data)}\n\n"


json_str = json.encoder.encode_basestring  # what _ENCODER.encode does with a str, without its type checks


def json_member(key: str, value) -> str:
    """`,"key":value` (leading comma): one member of a JSON object built by hand."""
    return f',"{key}":null' if value is None else f',"{key}":{_ENCODER.encode(value)}'


def chunk_head(id_: str, object_: str, created: int, model: str) -> str:
    """`data: {"id":..,"object":..,"created":..,"model":..,"choices":[`: the fixed start of every streamed
    chunk of one response, in the field order of the pydantic chunk models."""
    return (f'data: {{"id":{json_text(id_)}{json_member("object", object_)}{json_member("created", created)}'
            f'{json_member("model", model)},"choices":[')


CHUNK_TAIL = "]}\n\n"  # closes "choices" and the chunk (usage / prompt ids omitted)
USAGE_NULL_TAIL = '],"usage":null}\n\n'  # the same where the stream ends with a usage chunk


def chunk_event(chunk: BaseModel, include_usage: bool) -> str:
    """sse_event of a streamed chunk before the usage chunk: with include_usage every such chunk carries
    `"usage": null`, as OpenAI's do."""
    data = dump(chunk)
    if include_usage:
        data.setdefault("usage", None)
    return f"data: {json_text(data)}\n\n"


@dataclass(frozen=True)
class ChunkFrame:
    """What every streamed chunk of one response shares: the bytes before its choices (`head`: id, object,
    created, model) and after them (`tail`), and whether it carries `"usage": null` (include_usage)."""

    head: str
    tail: str
    include_usage: bool

    def event(self, chunk: BaseModel) -> str:
        """The chunk built by pydantic (chunk_event); the hot path writes head + choice + tail by hand."""
        return chunk_event(chunk, self.include_usage)


class UsageChunkFrame:
    """A ChunkFrame whose chunks each carry the request's usage so far (stream_options.continuous_usage_stats)
    where the others carry `"usage": null`: its tail is built from the running counts at every chunk."""

    def __init__(self, head: str, running: RunningUsage):
        self.head = head
        self.running = running  # the stream's CountedChoices advance it

    @property
    def tail(self) -> str:
        """`],"usage":{...}}`: the bytes pydantic writes for the Usage (its field order), the chunk's end."""
        p, c = self.running.prompt_tokens, self.running.completion_tokens
        return f'],"usage":{{"prompt_tokens":{p},"completion_tokens":{c},"total_tokens":{p + c}}}}}\n\n'

    def event(self, chunk: BaseModel) -> str:
        chunk.usage = self.running.usage()  # in the chunk model's own field order (before prompt ids)
        return sse_event(chunk)


def chunk_frame(id_: str, object_: str, created: int, model: str, include_usage: bool,
                running: RunningUsage | None = None) -> ChunkFrame | UsageChunkFrame:
    """The frame of one response's chunks; `running` (continuous usage): each carries the usage so far."""
    head = chunk_head(id_, object_, created, model)
    if running is not None:
        return UsageChunkFrame(head, running)
    return ChunkFrame(head, USAGE_NULL_TAIL if include_usage else CHUNK_TAIL, include_usage)


def sse_error(err: APIError) -> str:
    return sse_event(error_body(err.status, err.message, err.param, err.code))


async def with_error_events(events: AsyncIterator[str], request_id: str | None = None) -> AsyncIterator[str]:
    """Passes events through; a failure mid-stream becomes an error event (never a traceback), then [DONE].
    `request_id`: the one the log line names."""
    try:
        async with aclosing(events) as inner:
            async for event in inner:
                yield event
    except APIError as e:
        yield sse_error(e)
    except RequestRejected as e:
        yield sse_error(rejected_to_api_error(e))
    except Exception:
        logger.exception("error while streaming request %s", request_id)
        yield sse_error(APIError(500, "Internal server error.", code="internal_error"))
    yield SSE_DONE


class EventStreamResponse(StreamingResponse):
    """An SSE response whose event iterator is always closed when the response ends, however it ends
    (client disconnect cancels the send loop; closing the iterator aborts the engine requests)."""

    def __init__(self, events: AsyncIterator[str], reservation: Reservation | None = None,
                 request_id: str | None = None):
        super().__init__(with_error_events(events, request_id), media_type="text/event-stream",
                         headers=SSE_HEADERS)
        self.reservation = reservation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if _spec_version(scope) >= (2, 4):  # a send to a gone client raises: nothing to watch
                await super().__call__(scope, receive, send)
            else:
                await self.stream_until_disconnect(receive, send)
        finally:
            await self.body_iterator.aclose()
            if self.reservation is not None:  # places of prompts that never reached the engine
                self.reservation.release()

    async def stream_until_disconnect(self, receive: Receive, send: Send) -> None:
        """StreamingResponse's ASGI < 2.4 path (uvicorn's): stream while watching for http.disconnect,
        whichever ends first cancels the other, the stream's error is raised; on two asyncio tasks
        instead of Starlette's anyio task group, whose cancel scope also formats the task's repr at
        every cancel: ~1/5 of the API process's CPU per request (tools/api_bench --output-len 1,
        docs/benchmarks/api_cpu.md)."""
        streaming = asyncio.ensure_future(self.stream_response(send))
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait((streaming, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            streaming.cancel()
            listening.cancel()
            await asyncio.wait((streaming, listening))
        for task in (streaming, listening):
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()


def _spec_version(scope: Scope) -> tuple[int, ...]:
    return tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))


BODY_SLICE_BYTES = 256 * 1024  # a JSON answer larger than this is written a slice at a time


async def build_response(build: Callable[..., bytes], *args, heavy: bool) -> bytes:
    """build(*args): a non-streamed answer's JSON, in a request-work thread where it is `heavy` (logprobs:
    up to max_logprob_entries records, a million by default, whose models and JSON took 1.1 s of the event
    loop and stalled every stream: a review), inline otherwise."""
    return await run_in_worker(build, *args) if heavy else build(*args)


class SlicedResponse(Response):
    """A JSON body written BODY_SLICE_BYTES at a time, each write waiting while the client's socket buffer is
    full: a client that reads nothing then meets the connection's stall deadline (server/api/connections.py)
    rather than having the whole answer copied into the transport's buffer at once (megabytes of an echo
    with logprobs for a request of kilobytes: a review)."""

    media_type = "application/json"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body = memoryview(self.body)
        for start in range(0, len(body), BODY_SLICE_BYTES):
            await send({"type": "http.response.body", "body": bytes(body[start:start + BODY_SLICE_BYTES]),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def job_response(request: Request, stream: bool, events: Callable[[], AsyncIterator[str]],
                       body: Callable[[], Awaitable[str]],
                       reservation: Reservation | None = None) -> Response:
    """The answer to an admitted request: an SSE stream of `events()`, or the JSON `body()`, awaited while
    watching the client (gone before it is ready: 499, and the engine requests are aborted). The
    reservation's places left are released when the answer ends."""
    if stream:
        return EventStreamResponse(events(), reservation, request_id_of(request.scope))
    try:
        content = await unless_disconnected(request, body())
    except ClientDisconnected:
        logger.info("client went away before its answer was ready (%s, request %s)", request.url.path,
                    request_id_of(request.scope))
        return Response(status_code=499)
    finally:
        if reservation is not None:
            reservation.release()
    if len(content) > BODY_SLICE_BYTES:
        return SlicedResponse(content=content)
    return Response(content=content, media_type="application/json")
