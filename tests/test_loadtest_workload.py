"""loadtest workload: prompt lengths, id ranges, seeded Poisson/gamma arrivals."""

import numpy as np
import pytest

from loadtest.workload import ChatCalibration, LengthRange, arrival_offsets, build_workload


def test_token_prompts_have_exact_length_and_safe_ids():
    specs = build_workload(20, LengthRange(17, 17), LengthRange(5, 5), seed=3, vocab_range=(32, 126))
    assert [s.index for s in specs] == list(range(20))
    for s in specs:
        assert isinstance(s.prompt, list) and len(s.prompt) == 17 == s.input_len
        assert all(32 <= t <= 126 for t in s.prompt)
        assert s.output_len == 5
    assert len({tuple(s.prompt) for s in specs}) == 20  # random: no accidental shared prefixes


def test_length_ranges_are_uniform_inclusive():
    specs = build_workload(400, LengthRange(4, 8), LengthRange(1, 3), seed=0)
    assert {s.input_len for s in specs} == {4, 5, 6, 7, 8}
    assert {s.output_len for s in specs} == {1, 2, 3}
    assert all(len(s.prompt) == s.input_len for s in specs)


@pytest.mark.parametrize("first, second", [(128, 256), (128, 64)])
def test_other_lengths_with_the_same_seed_share_no_prompt_prefix(first, second):
    # one stream for every prompt made a run at 256 tokens send the 128-token run's prompts joined in pairs,
    # and a run at 64 their first halves: prefix-cache hits across a sweep of input lengths
    a = build_workload(16, LengthRange(first, first), LengthRange(64, 64), seed=0)
    b = build_workload(16, LengthRange(second, second), LengthRange(64, 64), seed=0)
    k = min(first, second)
    seen = {tuple(s.prompt[:k]) for s in a}
    assert not any(tuple(s.prompt[:k]) in seen for s in b)


def test_the_first_prompts_do_not_depend_on_the_request_count():
    a = build_workload(5, LengthRange(8, 16), LengthRange(4, 4), seed=1)
    b = build_workload(9, LengthRange(8, 16), LengthRange(4, 4), seed=1)
    assert b[:5] == a  # loadtest/prefix_cache.py: the same seed gives the same first N prompts


def test_same_seed_same_workload_other_seed_differs():
    a = build_workload(5, LengthRange(8, 16), LengthRange(4, 4), seed=1)
    b = build_workload(5, LengthRange(8, 16), LengthRange(4, 4), seed=1)
    c = build_workload(5, LengthRange(8, 16), LengthRange(4, 4), seed=2)
    assert a == b and a != c


def test_chat_prompts_leave_room_for_the_template():
    specs = build_workload(4, LengthRange(30, 30), LengthRange(4, 4), 0, endpoint="chat",
                           chat=ChatCalibration(7, 1.0))
    assert all(isinstance(s.prompt, str) and len(s.prompt) == 23 and s.input_len == 30 for s in specs)
    assert all(s.prompt.isalpha() and s.prompt.isascii() for s in specs)
    with pytest.raises(ValueError, match="chat template"):
        build_workload(1, LengthRange(7, 7), LengthRange(4, 4), seed=0, endpoint="chat",
                       chat=ChatCalibration(7, 1.0))
    bpe = build_workload(2, LengthRange(64, 64), LengthRange(4, 4), 0, endpoint="chat",
                         chat=ChatCalibration(20, 0.25))  # 4 letters a token: 176 letters make 44 tokens
    assert [len(s.prompt) for s in bpe] == [176, 176]


@pytest.mark.parametrize("text, expected", [("16", (16, 16)), ("8,64", (8, 64)), ("3:5", (3, 5))])
def test_length_range_parse(text, expected):
    r = LengthRange.parse(text)
    assert (r.low, r.high) == expected


@pytest.mark.parametrize("text", ["0", "9,3", "1,2,3", ""])
def test_length_range_parse_rejects(text):
    with pytest.raises(ValueError):
        LengthRange.parse(text)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, float("inf"), 1.0, seed=0) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_gamma_arrivals_have_the_requested_rate(burstiness):
    rate, n = 20.0, 20000
    offsets = arrival_offsets(n, rate, burstiness, seed=11)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.03)
    # gamma(shape k): coefficient of variation^2 = 1/k (Poisson: 1; bursty k < 1: larger)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0 / burstiness, rel=0.08)
    assert arrival_offsets(n, rate, burstiness, seed=11) == offsets
    assert arrival_offsets(n, rate, burstiness, seed=12) != offsets


def test_arrival_arguments_are_checked():
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, seed=0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, 0.0, seed=0)
