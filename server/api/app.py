"""create_app(engine): the FastAPI app over an AsyncEngine. The app holds no tensors."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from server.api import chat, completions, debug, models, monitoring, openapi_bodies, playground, tokenize
from server.api.admission import AdmissionGate, RequestLimits
from server.api.auth import BearerAuthMiddleware
from server.api.browser_guard import BrowserGuardMiddleware
from server.api.cors import CorsPolicy, add_cors
from server.api.errors import CatchAllMiddleware, install_error_handlers
from server.api.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimitMiddleware
from server.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.api.request_ids import RequestIdMiddleware
from server.heap import freeze_startup_heap

logger = logging.getLogger("pagewalk.api")
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0


def create_app(engine, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
               limits: RequestLimits | None = None, tool_call_parser: str | None = None,
               cors: CorsPolicy = CorsPolicy(), loopback_only: bool = False,
               allowed_hosts: tuple[str, ...] = (), debug_endpoints: bool = True) -> FastAPI:
    """The lifespan starts the engine and shuts it down (finishing or aborting in-flight requests).
    Tests that drive the app through httpx's ASGITransport start and stop the engine themselves.
    `tool_call_parser`: the format chat replies write tool calls in (server/api/tool_calls.py); None:
    tool_choice "auto" with tools is refused, as vLLM refuses it without --enable-auto-tool-choice.
    `cors`: the origins browsers may call it from (server/api/cors.py; none by default); `loopback_only`: it
    listens on loopback alone, so it answers Host names of loopback and `allowed_hosts` alone
    (server/api/browser_guard.py); `debug_endpoints`: /debug/kvcache answers (else a 404 that says how to turn
    it on: server/api/debug.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        freeze_startup_heap()
        try:
            yield
        finally:
            await stop_engine(app)

    app = FastAPI(title="pagewalk", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.created = int(time.time())
    app.state.shutdown_timeout_s = shutdown_timeout_s
    app.state.engine_stopped = False
    app.state.limits = limits or RequestLimits()
    app.state.tool_call_parser = tool_call_parser
    app.state.admission = AdmissionGate(engine)
    install_error_handlers(app)
    app.state.api_key = api_key  # /debug/* checks it itself (the middleware guards /v1/* only)
    app.state.debug_endpoints = debug_endpoints
    for module in (completions, chat, models, monitoring, debug, playground, tokenize):
        app.include_router(module.router)
    openapi_bodies.install(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                 DetokenizeRequest])
    # the last added runs first: a foreign Host or a cross-site write refused first, CORS preflights answered
    # before auth (401), auth before the body size (413), all inside the catch-all, and every answer, the
    # catch-all's included, with its X-Request-Id
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    add_cors(app, cors)
    app.add_middleware(BrowserGuardMiddleware, loopback_only=loopback_only,
                       allowed_origins=cors.allowed_origins, allowed_hosts=allowed_hosts)
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(RequestIdMiddleware)
    return app


async def stop_engine(app: FastAPI) -> None:
    """Shuts the engine down once (a thread, so streams keep flowing while it drains)."""
    if app.state.engine_stopped:
        return
    app.state.engine_stopped = True
    logger.info("stopping engine (in-flight requests finish or are aborted)")
    await asyncio.to_thread(app.state.engine.shutdown, timeout=app.state.shutdown_timeout_s)
