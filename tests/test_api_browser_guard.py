"""What a page on another site can make a browser send (server/api/browser_guard.py; a hostile review):
a rebound name's Host on a loopback-only server, a cross-site write without a preflight."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server.api.app import create_app
from server.api.browser_guard import host_name, listens_on_loopback_only
from server.api.cors import CorsPolicy

BODY = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
TEXT_PLAIN = {"Content-Type": "text/plain;charset=UTF-8"}  # a "simple" request: no preflight


def call(app, method: str, path: str, headers: dict, body: bytes | None = None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as c:
            return await c.request(method, path, headers=headers, content=body)
    return asyncio.run(go())


@pytest.mark.parametrize("path", ["/v1/models", "/debug/kvcache", "/health"])
def test_a_loopback_server_refuses_a_rebound_host(engine, path):
    """A page on rebind.example:8000 whose name now resolves to 127.0.0.1 is same-origin with itself: it read
    every answer (the block map, the models, completions without a key)."""
    app = create_app(engine, loopback_only=True)
    r = call(app, "GET", path, {"Host": "rebind.example:8000"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", r.text
    for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000"):
        assert call(app, "GET", "/v1/models", {"Host": host}).status_code == 200, host
    assert call(create_app(engine), "GET", "/v1/models", {"Host": "rebind.example"}).status_code == 200


def test_allowed_hosts_add_a_proxys_name(engine):
    """A reverse proxy on the machine that passes on its public Host (nginx `proxy_set_header Host $host`)
    names it with --allowed-hosts; "*" turns the check off; the refusal names the flag."""
    app = create_app(engine, loopback_only=True, allowed_hosts=("api.example.com",))
    assert call(app, "GET", "/v1/models", {"Host": "API.example.com"}).status_code == 200
    refused = call(app, "GET", "/v1/models", {"Host": "other.example"})
    assert refused.status_code == 400 and "--allowed-hosts" in refused.json()["error"]["message"]
    anyone = create_app(engine, loopback_only=True, allowed_hosts=("*",))
    assert call(anyone, "GET", "/v1/models", {"Host": "other.example"}).status_code == 200
    # the page a proxy serves posts from its public origin: the Host or X-Forwarded-Host it passes on
    page = {**TEXT_PLAIN, "Origin": "https://api.example.com", "X-Forwarded-Host": "api.example.com"}
    assert call(create_app(engine), "POST", "/v1/completions", page, BODY).status_code == 200


def test_only_a_loopback_listener_checks_hosts():
    assert all(map(listens_on_loopback_only, ["127.0.0.1", "localhost", "::1", "127.0.0.2"]))
    assert not any(map(listens_on_loopback_only, ["", "0.0.0.0", "::", "10.0.0.5"]))
    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:80", "Localhost")] == ["127.0.0.1", "::1",
                                                                                  "localhost"]


def test_a_cross_site_write_is_refused_and_runs_nothing(engine):
    """fetch(url, {method: "POST", mode: "no-cors", body}) from any site reaches the server without a
    preflight; the body was read as JSON and the completion ran."""
    app = create_app(engine)
    before = engine.num_prefill_tokens
    for origin in ("https://evil.example", "null"):
        r = call(app, "POST", "/v1/completions", {**TEXT_PLAIN, "Origin": origin}, BODY)
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin", r.text
    assert engine.num_prefill_tokens == before
    same_site = call(app, "POST", "/v1/completions", {**TEXT_PLAIN, "Origin": "http://127.0.0.1:8000"}, BODY)
    no_origin = call(app, "POST", "/v1/completions", TEXT_PLAIN, BODY)  # curl, SDKs
    read_only = call(app, "GET", "/v1/models", {"Origin": "https://evil.example"})
    assert (same_site.status_code, no_origin.status_code, read_only.status_code) == (200, 200, 200)
    named = create_app(engine, cors=CorsPolicy(("https://ui.example",)))
    assert call(named, "POST", "/v1/completions", {**TEXT_PLAIN, "Origin": "https://ui.example"},
                BODY).status_code == 200


def test_credentials_with_any_origin_are_refused():
    with pytest.raises(ValueError, match="credentials with any origin"):
        CorsPolicy(("*",), allow_credentials=True)
