"""GET /v1/models (the served model ids, in OpenAI's list shape), GET /v1/models/{id} (one of them, as
OpenAI's "retrieve model", which the openai client's models.retrieve calls) and GET /version (as vLLM's)."""

from __future__ import annotations

from importlib.metadata import version

from fastapi import APIRouter, Request

from server.api.parsing import check_model
from server.api.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    engine = request.app.state.engine
    names = list(engine.config.served_model_name) or [engine.model_name]
    cards = [ModelCard(id=name, created=request.app.state.created, max_model_len=engine.max_model_len)
             for name in names]
    return ModelList(data=cards).model_dump(mode="json")


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict:
    """Any id a request may name (parsing.model_names, a checkpoint's path included); else 404."""
    engine = request.app.state.engine
    check_model(engine, model_id)
    card = ModelCard(id=model_id, created=request.app.state.created, max_model_len=engine.max_model_len)
    return card.model_dump(mode="json")


@router.get("/version")
async def server_version() -> dict:
    return {"version": version("pagewalk")}
