"""SamplingParams.validate: every bad field is named with its value."""

from __future__ import annotations

import pytest

from server.engine.sampling_params import SamplingParams


def test_defaults_validate_and_normalise():
    p = SamplingParams(stop="x", top_k=-1)
    p.validate(100)
    assert p.stop == ["x"] and p.top_k == 0 and not p.greedy and not p.has_penalties
    assert SamplingParams(temperature=0).greedy and SamplingParams(repetition_penalty=1.1).has_penalties


@pytest.mark.parametrize("kwargs, message", [
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
    ({"top_k": -3}, "top_k must be an integer in [0, 2**63)"),
    ({"min_p": 1.2}, "min_p must be in [0, 1], got 1.2"),
    ({"n": 0}, "n must be in [1, 64], got 0"),
    ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
    ({"stop": [""]}, "stop strings must be non-empty strings"),
    ({"stop_token_ids": [100]}, "stop_token_ids must be in [0, 100), got 100"),
])
def test_validate_names_the_field(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs).validate(100)
    assert message in str(e.value)


@pytest.mark.parametrize("kwargs", [dict(stop_token_ids=[True]), dict(allowed_token_ids=[5, False]),
                                    dict(logit_bias={True: 1.0}), dict(stop_token_ids=[3, True, 7])])
def test_a_bool_in_an_id_list_is_an_int_as_before(kwargs):
    """bools are ints to isinstance: the id checks' fast path (plain ints) falls back to it, and finds no
    bad id (it raised a bare StopIteration, which no caller catches)."""
    SamplingParams(**kwargs).validate(300)
