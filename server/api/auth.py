"""Bearer-token auth for /v1/* and the API's schema (/openapi.json, /docs): `Authorization: Bearer <key>`,
compared in constant time."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api.errors import APIError, error_response

PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = frozenset({"/openapi.json", "/docs", "/redoc"})


def is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def token_matches(token: str | None, api_key: str) -> bool:
    presented = (token or "").encode()
    return hmac.compare_digest(presented, api_key.encode()) and token is not None


class BearerAuthMiddleware:
    """Answers 401 before any body is read when a protected path lacks the right key; other paths pass."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_protected(scope["path"]):
            token = bearer_token(Headers(scope=scope).get("authorization"))
            if not token_matches(token, self.api_key):
                message = ("Missing bearer token: send 'Authorization: Bearer <api key>'." if token is None
                           else "Incorrect API key provided.")
                err = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
