"""Held-back and banned ids stay out of a draw at any temperature the API takes: their floor (HOLD_BACK,
-1e30) is scaled by the row's temperature, capped at MAX_TEMPERATURE (at 1e30, (-1e30 - top) / 1e30 ~ -1
kept e^-1 of a free token's weight: a banned word drawn a quarter of the time, in a review)."""

from __future__ import annotations

import pytest

from server.api.app import create_app
from server.engine.sampler import MAX_TEMPERATURE, row_fields
from server.engine.sampling_params import SamplingParams
from server.model.tokenizer import ByteTokenizer
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(180)

A, B = ByteTokenizer.OFFSET + ord("a"), ByteTokenizer.OFFSET + ord("b")


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=128) as engine:
        yield create_app(engine)


def test_a_banned_token_stays_out_of_a_high_temperature_draw(app):
    r = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 24, "temperature": 1e30, "seed": 1,
                                      "allowed_token_ids": [A, B], "bad_words": ["b"]})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == "a" * 24


def test_eos_stays_held_back_until_min_tokens_at_a_high_temperature(app):
    r = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 24, "min_tokens": 24, "temperature": 3e38,
                                      "seed": 2, "allowed_token_ids": [A, ByteTokenizer.EOS]})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length" and choice["text"] == "a" * 24


def test_a_rows_temperature_is_capped():
    floats, _ = row_fields(SamplingParams(temperature=1e30), seed_key=1, num_sampled=0)
    assert floats[0] == MAX_TEMPERATURE
    floats, _ = row_fields(SamplingParams(temperature=0.7), seed_key=1, num_sampled=0)
    assert floats[0] == 0.7
