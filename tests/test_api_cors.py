"""CORS (server/api/cors.py): off by default; with --allowed-origins a browser's preflight is answered before
the bearer-token check (it carries no key), the request after it gets the CORS headers, and an origin not
named is refused. (A review found these.)"""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from server.api.app import create_app
from server.api.cors import CorsPolicy
from server.cli import json_list
from tests.asgi_client import post

PREFLIGHT = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
BODY = {"prompt": "hi", "max_tokens": 2}


def call(app, method: str, path: str, headers: dict | None = None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, headers=headers)
    return asyncio.run(go())


def test_no_cors_headers_unless_origins_are_named(engine):
    r = call(create_app(engine), "OPTIONS", "/v1/completions", PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers


def test_a_preflight_is_answered_before_the_key_and_the_request_after_it_carries_the_headers(engine):
    app = create_app(engine, api_key="k", cors=CorsPolicy(("http://ui.example",)))
    pre = call(app, "OPTIONS", "/v1/completions", PREFLIGHT)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
    assert "x-request-id" in pre.headers
    ok = post(app, "/v1/completions", BODY, {"Origin": "http://ui.example", "Authorization": "Bearer k"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ui.example"
    refused = post(app, "/v1/completions", BODY, {"Origin": "http://ui.example"})
    assert refused.status_code == 401  # the key is still asked for, and the browser may read why
    assert refused.headers["access-control-allow-origin"] == "http://ui.example"
    other = call(app, "OPTIONS", "/v1/completions", {**PREFLIGHT, "Origin": "http://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_the_origins_flag_takes_a_json_list_of_strings():
    assert json_list('["*"]') == ["*"] and json_list("[]") == []
    for bad in ("*", '"*"', "[1]", "{}"):
        with pytest.raises(argparse.ArgumentTypeError):
            json_list(bad)
