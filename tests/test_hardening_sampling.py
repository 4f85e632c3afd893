"""Finding 4 of issue 17: no NaN reaches a token. Extreme sampling values either sample greedily (temperature
below the threshold, top_p or min_p that keep only the top token) or are refused at the API (a value float32
cannot hold, which made a masked logit NaN and streamed an arbitrary id)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from server.api.app import create_app
from server.engine.sampler import Sampler, row_fields, step_flags
from server.engine.sampling_params import SamplingParams
from server.model.tokenizer import ByteTokenizer
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(model="tiny", device="cpu", attention_backend="torch", num_blocks=64)
# printable ASCII, newline, BOS, EOS: the ids the tiny preset does not mask with an -inf logit
VALID = {ByteTokenizer.BOS, ByteTokenizer.EOS, ByteTokenizer.OFFSET + 10,
         *range(ByteTokenizer.OFFSET + 32, ByteTokenizer.OFFSET + 127)}
MASKED_PROMPT = [1, 3, 4, 200, 77, 80, 90]  # ids 3, 4, 200 are masked: repetition penalties touch them


@pytest.fixture(scope="module")
def app():
    with started_engine(**CFG) as engine:
        yield create_app(engine)


def complete(app, **fields) -> httpx.Response:
    body = {"prompt": MASKED_PROMPT, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True, **fields}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/completions", json=body, timeout=60)
    return asyncio.run(go())


def tokens(app, **fields) -> list[int]:
    r = complete(app, **fields)
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert len(ids) == 8 and set(ids) <= VALID, (fields, ids)
    return ids


@pytest.mark.parametrize("fields", [
    dict(temperature=1e-40), dict(temperature=1e-40, top_p=1e-46), dict(temperature=1.0, top_p=1e-46),
    dict(temperature=2.0, min_p=1.0), dict(temperature=1e-6, seed=3),
])
def test_extremes_that_keep_the_top_token_sample_greedily(app, fields):
    assert tokens(app, **fields) == tokens(app, temperature=0)


@pytest.mark.parametrize("fields", [
    dict(temperature=1e30), dict(temperature=1.0, repetition_penalty=1e30, seed=1),
    dict(temperature=0, repetition_penalty=1e-30), dict(temperature=5.0, top_k=1_000_000, min_p=1e-46),
])
def test_large_and_small_values_give_valid_tokens(app, fields):
    tokens(app, **fields)


@pytest.mark.parametrize("field, value", [("temperature", 1e39), ("temperature", 1e300),
                                          ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300)])
def test_values_float32_cannot_hold_are_400(app, field, value):
    r = complete(app, **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_sampler_rows_with_extreme_values_give_finite_tokens():
    V = 64
    logits = torch.randn(6, V)
    logits[:, V - 8:] = float("-inf")  # masked ids, as the presets have
    cases = [SamplingParams(temperature=1e-40), SamplingParams(temperature=1.0, top_p=1e-46),
             SamplingParams(temperature=3e38), SamplingParams(temperature=1.0, min_p=1.0),
             SamplingParams(temperature=1e-5, top_k=3),
             SamplingParams(temperature=1.0, repetition_penalty=1e-30)]
    for p in cases:
        sampler = Sampler(6, V, torch.device("cpu"))
        floats, ints = zip(*(row_fields(p, 7 + r, 0) for r in range(6)), strict=True)
        rows = torch.arange(6)
        sampler.init_rows(rows, torch.tensor(floats, dtype=torch.float32), torch.tensor(ints))
        if p.has_penalties:
            sampler.init_penalty_rows(rows, rows, torch.full((6,), V - 1), torch.zeros(6, dtype=torch.bool))
        out = sampler(logits, rows, step_flags(p)).token_ids
        assert torch.isfinite(logits.gather(1, out[:, None])).all(), (p, out)
        if p.top_p < 1e-30 or p.min_p == 1.0 or p.greedy:
            assert out.tolist() == logits.argmax(-1).tolist(), p
