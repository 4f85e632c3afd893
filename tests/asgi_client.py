"""In-process HTTP calls to the API's ASGI app (no server, no socket): the API tests' client."""

from __future__ import annotations

import asyncio

import httpx


async def post_async(app, path: str, body: dict, headers=None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.post(path, json=body, headers=headers, timeout=60)


def post(app, path: str, body: dict, headers=None) -> httpx.Response:
    """`headers`: a dict, or a list of (name, value) pairs (a name may repeat)."""
    return asyncio.run(post_async(app, path, body, headers))


def get(app, path: str, headers=None) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(path, headers=headers)
    return asyncio.run(go())
