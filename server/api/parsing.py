"""Request bodies -> validated pydantic models, with OpenAI errors for everything that goes wrong."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from server.api.errors import APIError, validation_error

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model_cls: type[M]) -> M:
    """Any content type is read as JSON (curl -d sends form-encoded headers)."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "Request body is empty; expected a JSON object.", code="invalid_json")
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, "Request body must be a JSON object.", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _load_json(raw: bytes) -> object:
    """json.loads, with 400s for bad JSON, nesting too deep to decode and unpaired surrogate escapes
    ("\\ud800"), which decode to a str no tokenizer can encode."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "Request body is not valid JSON.", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "Request body is nested too deeply.", code="invalid_json") from None
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "Request body contains an unpaired UTF-16 surrogate escape (e.g. \"\\ud800\"); "
                            "strings must be valid Unicode.", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "Request body is nested too deeply.", code="invalid_json") from None
    return data


def model_names(engine) -> list[str]:
    """The ids a request may name: --served-model-name's (the first is the one responses carry), or the
    model's own name, plus the --model value as given (a checkpoint's full path)."""
    names = list(engine.config.served_model_name) or [engine.model_name]
    return names + [engine.config.model] if engine.config.model not in names else names


def check_model(engine, requested: str | None) -> None:
    """A request may omit `model`; naming another model than the one served is a 404."""
    if requested is not None and requested not in model_names(engine):
        raise APIError(404, f"The model '{requested}' does not exist; this server serves "
                            f"'{engine.model_name}'.", "model", "model_not_found")
