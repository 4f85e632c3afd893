"""Cross-origin access for browser clients on another origin (vLLM's --allowed-origins and its three
companions), through Starlette's CORSMiddleware.

Off unless --allowed-origins names origins: vLLM allows every origin by default, but a page on any site a
user visits could then call a server on the user's own machine and read its answers (pagewalk listens on
127.0.0.1 by default for the same reason). The middleware sits outside the bearer-token check: a browser's
preflight (OPTIONS) never carries Authorization, so it is answered before the key is asked for, as vLLM
answers it; the request that follows carries the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...] = ()  # () : no CORS headers at all
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        if "*" in self.allowed_origins and self.allow_credentials:  # Starlette then reflects any origin
            raise ValueError("credentials with any origin would let every site read a user's answers")


def add_cors(app: FastAPI, policy: CorsPolicy) -> None:
    """Adds the middleware where the policy allows any origin (call it after the bearer-token middleware:
    the last added runs first)."""
    if policy.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(policy.allowed_origins),
                           allow_credentials=policy.allow_credentials,
                           allow_methods=list(policy.allowed_methods),
                           allow_headers=list(policy.allowed_headers))
