"""GET /v1/models: the one model this server serves, in OpenAI's list shape."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.api.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    engine = request.app.state.engine
    card = ModelCard(id=engine.model_name, created=request.app.state.created,
                     max_model_len=engine.max_model_len)
    return ModelList(data=[card]).model_dump(mode="json")
