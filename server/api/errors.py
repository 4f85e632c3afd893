"""OpenAI error bodies and the exception handlers that produce them.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}`; no traceback ever leaves
the process (unexpected exceptions are logged here and answered with a generic 500).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("pagewalk.api")

# status -> (OpenAI error type, default code)
ERROR_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "unprocessable_entity"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("service_unavailable_error", "service_unavailable"),
}


class APIError(Exception):
    """An error answered to the client with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    err_type, default_code = ERROR_TYPES.get(status, ("invalid_request_error" if status < 500
                                                       else "server_error", str(status)))
    return {"error": {"message": message, "type": err_type, "param": param, "code": code or default_code}}


def error_response(err: APIError) -> JSONResponse:
    body = error_body(err.status, err.message, err.param, err.code)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic puts union member names ("str", "list[int]"), a tagged union's member tags ("type=tag": a
    # structural tag's format nodes) and function validator names in loc
    parts = [p for p in parts
             if p not in _TYPE_TAGS and "[" not in p and "=" not in p and not p.startswith("function-")]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


_NOUNS = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
          "bool": ("a boolean", "booleans"), "none": ("null", "nulls")}


def _form(tag: str, plural: bool = False) -> str | None:
    """A union member's tag ("list[list[int]]") in words ("a list of lists of integers"); None if unknown."""
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _form(tag[5:-1], plural=True)
        return inner and ("lists of " if plural else "a list of ") + inner
    return _NOUNS[tag][plural] if tag in _NOUNS else None


def _union_forms(errors: list[dict], loc: tuple) -> list[str]:
    """Where every member of a union field failed (pydantic reports each, its tag in loc after the field):
    the members' forms in words, in order; [] otherwise."""
    at = next((i for i, p in enumerate(loc) if isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)), None)
    if at is None:
        return []
    tags = list(dict.fromkeys(e["loc"][at] for e in errors
                              if len(e.get("loc", ())) > at and tuple(e["loc"][:at]) == loc[:at]))
    forms = [_form(str(t)) for t in tags]
    return forms if len(forms) > 1 and None not in forms else []


def validation_error(errors: list[dict]) -> APIError:
    """Turns pydantic/FastAPI validation errors into a 400 naming the first offending field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = tuple(first.get("loc", ()))
    param = _loc_to_param(loc)
    if first.get("type") == "json_invalid":
        return APIError(400, "Request body is not valid JSON.", None, "invalid_json")
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    forms = _union_forms(errors, loc)
    if forms:  # the first member's complaint ("a valid string") would say a list is never taken
        msg = f"it must be {', '.join(forms[:-1])} or {forms[-1]}"
    if first.get("type") == "missing":
        return APIError(400, f"Missing required field '{param}'.", param, "missing_field")
    message = f"Invalid value for '{param}': {msg}" if param else f"Invalid request body: {msg}"
    return APIError(400, message, param, "invalid_value")


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _request_validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(list(exc.errors())))


async def _pydantic_validation_handler(request: Request, exc: ValidationError) -> JSONResponse:
    return error_response(validation_error(exc.errors()))


async def _http_exception_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} not allowed for {request.url.path}"
    else:
        message = str(exc.detail)
    headers = dict(exc.headers) if exc.headers else None
    return error_response(APIError(exc.status_code, message, headers=headers))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _request_validation_handler)
    app.add_exception_handler(ValidationError, _pydantic_validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)


class CatchAllMiddleware:
    """Last line of defence: an exception no handler took becomes a logged, generic 500 OpenAI body."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = client_gone = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, client_gone
            started = started or message["type"] == "http.response.start"
            try:
                await send(message)
            except Exception:  # the server says the client is gone (ASGI spec 2.4: OSError)
                client_gone = True
                raise

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            # uvicorn cancels what is still running when its graceful shutdown times out (a core that stopped
            # answering): the client gets an OpenAI 503 instead of uvicorn's plain-text 500
            if not started and not client_gone:
                err = APIError(503, "The server is shutting down.", code="shutting_down")
                with contextlib.suppress(Exception):
                    await error_response(err)(scope, receive, send)
            raise
        except Exception as exc:
            if client_gone or isinstance(exc, ClientDisconnect):  # nobody to answer; not a server error
                logger.info("client went away during %s %s", scope.get("method"), scope.get("path"))
                return
            if isinstance(exc, APIError):
                err = exc
            else:
                logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
                err = APIError(500, "Internal server error.", code="internal_error")
            if not started:
                await error_response(err)(scope, receive, send)
