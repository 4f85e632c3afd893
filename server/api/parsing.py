"""Request bodies -> validated pydantic models, with OpenAI errors for everything that goes wrong."""

from __future__ import annotations

import json
import re
from typing import TypeVar

import msgspec
from fastapi import Request
from pydantic import BaseModel, ValidationError

from server.api.errors import APIError, validation_error
from server.api.json_text import NonFiniteNumber, loads_finite
from server.api.request_work import run_request_work

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model_cls: type[M]) -> M:
    """Any content type is read as JSON (curl -d sends form-encoded headers)."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "Request body is empty; expected a JSON object.", code="invalid_json")
    return await run_request_work(request, _validated, raw, model_cls)


def _validated(raw: bytes, model_cls: type[M]) -> M:
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, "Request body must be a JSON object.", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _load_json(raw: bytes) -> object:
    """The body's JSON value, with 400s for bad JSON, nesting too deep to decode and unpaired surrogate
    escapes ("\\ud800"), which decode to a str no tokenizer can encode. msgspec decodes first (a body of 512
    token ids: 12.7 us against json.loads' 38.8, timeit on the CI CPU); what it refuses (bad JSON, and
    what json.loads takes but msgspec does not: lone surrogate escapes, nesting past msgspec's depth bound)
    goes to json.loads, whose outcome then decides, so both paths accept and refuse the same bodies. Both
    refuse NaN, Infinity and numbers past the float range (1e400), which are no JSON numbers (RFC 8259):
    every float field refuses them anyway, and inside a free-form object (a JSON schema, a tool's
    parameters) json.loads' NaN would reach the grammar compiler, which reads it as null."""
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        data = _load_json_stdlib(raw)
    if not _may_hold_surrogates(raw):
        return data
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "Request body contains an unpaired UTF-16 surrogate escape (e.g. \"\\ud800\"); "
                            "strings must be valid Unicode.", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "Request body is nested too deeply.", code="invalid_json") from None
    return data


def _load_json_stdlib(raw: bytes) -> object:
    try:
        return loads_finite(raw)
    except NonFiniteNumber as e:
        raise APIError(400, f"Request body is not valid JSON: {e}", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "Request body is not valid JSON.", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "Request body is nested too deeply.", code="invalid_json") from None


# a \uD800-\uDFFF escape (or text that only looks like one, e.g. after an escaped backslash: the full check
# below then decides)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_DEEP = 256  # brackets: beyond this the encoder's own recursion bound is checked as well


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether the re-encoding check can fail for this body: only an escaped surrogate decodes to one (raw
    UTF-8 cannot hold them), and only deep nesting reaches the encoder's recursion bound. Skipping it for
    the rest saves re-encoding every request body (~1/30 of a request's API CPU, tools/api_bench
    --output-len 1)."""
    return (_SURROGATE_ESCAPE.search(raw) is not None
            or raw.count(b"[") + raw.count(b"{") > _DEEP)


def model_names(engine) -> list[str]:
    """The ids a request may name: --served-model-name's (the first is the one responses carry), or the
    model's own name, plus the --model value as given (a checkpoint's full path)."""
    names = list(engine.config.served_model_name) or [engine.model_name]
    return names + [engine.config.model] if engine.config.model not in names else names


def check_model(engine, requested: str | None) -> None:
    """A request may omit `model` (or send "", as vLLM takes it); naming another model than the one served is
    a 404."""
    if requested and requested not in model_names(engine):
        raise APIError(404, f"The model '{requested}' does not exist; this server serves "
                            f"'{engine.model_name}'.", "model", "model_not_found")
