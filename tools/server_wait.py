"""Waiting for a server a tool started: poll GET /health until it answers 200."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx


class ServerNotHealthy(RuntimeError):
    """The server's process ended, or /health did not answer 200 in time."""


def wait_healthy(url: str, is_alive: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> None:
    """Returns once `url`/health answers 200; ServerNotHealthy if `is_alive()` turns false first or
    `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive():
            raise ServerNotHealthy("the server exited before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise ServerNotHealthy(f"the server was not healthy in {timeout_s:.0f} s")
