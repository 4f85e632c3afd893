"""In-process HTTP calls to the API's ASGI app (no server, no socket): the API tests' client."""

from __future__ import annotations

import asyncio

import httpx


async def post_async(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body, timeout=60)


def post(app, path: str, body: dict) -> httpx.Response:
    return asyncio.run(post_async(app, path, body))


def get(app, path: str) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(path)
    return asyncio.run(go())
