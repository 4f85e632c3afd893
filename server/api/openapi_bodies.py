"""The request bodies in /openapi.json: the handlers parse their bodies themselves (any content type is read
as JSON, with OpenAI errors), so FastAPI cannot see them; each route names its pydantic model here and the
schema carries it, $defs moved into components (clients and schemathesis read it)."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel], example: dict | None = None) -> dict:
    """openapi_extra of a route whose JSON body is `model`; `example`: a body the route serves."""
    schema = model.model_json_schema(ref_template=REF)
    schema.pop("$defs", None)
    media = {"schema": schema} | ({"example": example} if example is not None else {})
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def install(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Adds the models' nested definitions to components.schemas once the schema is built."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            defs = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                defs.update(model.model_json_schema(ref_template=REF).get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
