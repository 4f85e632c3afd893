"""Where the work on a request's body runs: inline for small bodies, in a worker thread for large ones.

Validating the body, rendering a chat request's template and tokenizing its prompt, stop and bad words run
in the request's handler. On a large body that work holds the event loop, and with it every other stream's
tokens: a 1 MB chat body of 30,000 short messages took ~160 ms to validate and ~250 ms to render and
encode, a 1 MB text prompt ~95 ms to encode (the CI CPU, tiny preset: a hostile review's measurement). A
worker thread lets the loop keep turning (the tokenizer's Rust code and the template's Python share the
GIL, which switches every 5 ms), as /tokenize already does. The hop itself costs ~0.26 ms of latency on that
CPU (1,000 sequential asyncio.to_thread calls), as much as encoding ~4 KB of text, so bodies up to
INLINE_BODY_BYTES stay inline: a 512-token prompt's body is ~2-3 KB.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")

INLINE_BODY_BYTES = 4096


async def run_request_work(request: Request, work: Callable[..., T], *args) -> T:
    """work(*args), in a worker thread when the request's body is larger than INLINE_BODY_BYTES (its
    exceptions, the 400s included, propagate either way)."""
    if len(await request.body()) <= INLINE_BODY_BYTES:  # starlette keeps the body once read
        return work(*args)
    return await asyncio.to_thread(work, *args)
