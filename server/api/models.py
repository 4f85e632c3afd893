"""GET /v1/models (the served model ids, in OpenAI's list shape) and GET /version (as vLLM's)."""

from __future__ import annotations

from importlib.metadata import version

from fastapi import APIRouter, Request

from server.api.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    engine = request.app.state.engine
    names = list(engine.config.served_model_name) or [engine.model_name]
    cards = [ModelCard(id=name, created=request.app.state.created, max_model_len=engine.max_model_len)
             for name in names]
    return ModelList(data=cards).model_dump(mode="json")


@router.get("/version")
async def server_version() -> dict:
    return {"version": version("pagewalk")}
