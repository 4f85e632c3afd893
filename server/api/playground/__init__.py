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

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(HERE / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/playground/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise APIError(404, f"no playground file {name!r}")
    return FileResponse(HERE / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})
