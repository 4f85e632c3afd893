"""GET|HEAD /health (engine.health(); 503 unless ok) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


# The hidden route serves both methods and is matched first, so a 405 on /health says "Allow: GET, HEAD";
# the GET route after it only documents /health in the OpenAPI schema (one route of both methods there would
# give the schema a duplicate operation id).
@router.get("/health")
@router.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
async def health(request: Request) -> JSONResponse:
    info = request.app.state.engine.health()
    return JSONResponse(info, status_code=200 if info.get("status") == "ok" else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    text = request.app.state.engine.metrics.exposition()
    return Response(content=text, media_type=CONTENT_TYPE_LATEST)
