"""Finding 9 of issue 17 (in-process): the schema needs the API key when one is set, the key is checked
before the body size (401 before 413), HEAD /health answers. (uvicorn's own 400 body:
test_hardening_connections.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.api.app import create_app
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(model="tiny", device="cpu", attention_backend="torch", num_blocks=32)
KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def app():
    with started_engine(**CFG) as engine:
        yield create_app(engine, api_key="s3cret", max_body_bytes=1000)


def request(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, timeout=60, **kw)
    return asyncio.run(go())


def test_openapi_schema_needs_the_key(app):
    for path in ("/openapi.json", "/docs"):
        r = request(app, "GET", path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", (path, r.text)
    ok = request(app, "GET", "/openapi.json", headers=KEY)
    assert ok.status_code == 200 and "/v1/completions" in ok.json()["paths"]


def test_auth_is_checked_before_the_body_size(app):
    big = b"{" + b" " * 5000 + b"}"
    assert request(app, "POST", "/v1/completions", content=big).status_code == 401
    assert request(app, "POST", "/v1/completions", content=big, headers=KEY).status_code == 413


def test_head_health(app):
    r = request(app, "HEAD", "/health")
    assert r.status_code == 200 and r.content == b""


def test_a_405_on_health_allows_get_and_head(app):
    r = request(app, "POST", "/health")
    assert r.status_code == 405
    assert sorted(m.strip() for m in r.headers["allow"].split(",")) == ["GET", "HEAD"]
    paths = request(app, "GET", "/openapi.json", headers=KEY).json()["paths"]
    assert list(paths["/health"]) == ["get"]


def test_the_key_guards_v1_and_the_schema_and_leaves_the_rest_open(app):
    """README: the key is asked for on /v1/* and /openapi.json (vLLM guards /v1); the probes, the
    tokenizer's routes, /version and the playground stay open."""
    assert request(app, "GET", "/v1/models").status_code == 401
    assert request(app, "GET", "/openapi.json").status_code == 401
    for method, path, body in [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/version", None),
                               ("GET", "/", None), ("POST", "/tokenize", {"prompt": "hi"}),
                               ("POST", "/detokenize", {"tokens": [5, 6]})]:
        r = request(app, method, path, json=body) if body else request(app, method, path)
        assert r.status_code == 200, (path, r.status_code, r.text[:200])
