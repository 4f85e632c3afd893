"""The playground page at `/`: static HTML, JS and CSS beside this file; no build step, nothing external.

The page calls the server's own API (/v1/models, /v1/completions, /v1/chat/completions, /debug/kvcache/stream)
with the API key the user types in, so the page itself is public.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from server.api.errors import APIError

HERE = Path(__file__).resolve().parent
ASSETS = {"app.js": "text/javascript", "kvmap.js": "text/javascript", "style.css": "text/css"}
# The page holds the API key: it runs its own files alone (no inline script or style, nothing from elsewhere),
# calls only its server, and no other site may frame it (a review found no header at all)
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                               "form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
}

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(HERE / "index.html", media_type="text/html", headers=HEADERS)


@router.get("/playground/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise APIError(404, f"no playground file {name!r}")
    return FileResponse(HERE / name, media_type=ASSETS[name], headers=HEADERS)
