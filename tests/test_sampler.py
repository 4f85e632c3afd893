"""Sampler unit tests on crafted logits: masks, penalties, greedy, distributions, seeds, logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from server.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
    token_counts,
)
from server.engine.sampling_params import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def logits_of(probs: list[float], batch: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(batch, 1)  # (B, V)


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits]


def test_top_k_keeps_exactly_k_best_per_row():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert kept(out) == [[1, 4], [0, 1, 2, 3, 4]]
    assert torch.equal(out[1], logits[1])
    assert out[0, 1] == 3.0 and out[0, 4] == 2.5


@pytest.mark.parametrize("top_p, expected", [(0.4, [0]), (0.7, [0, 1]), (0.8, [0, 1]), (0.81, [0, 1, 2]),
                                             (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, expected):
    out = apply_top_k_top_p(logits_of(PROBS), torch.tensor([0]), torch.tensor([top_p]))
    assert kept(out) == [expected]


def test_top_k_then_top_p_renormalises_after_k():
    # top_k=2 leaves {0.5, 0.3} -> renormalised 0.625, 0.375; top_p=0.6 then keeps only the first
    out = apply_top_k_top_p(logits_of(PROBS), torch.tensor([2]), torch.tensor([0.6]))
    assert kept(out) == [[0]]


@pytest.mark.parametrize("min_p, expected", [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.5, [0, 1]),
                                             (1.0, [0])])
def test_min_p_relative_to_best(min_p, expected):
    assert kept(apply_min_p(logits_of(PROBS), torch.tensor([min_p]))) == [expected]


def test_token_counts():
    counts = token_counts([[1, 1, 3], [], [0]], 4, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_penalties_math():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    row = Row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
              prompt_token_ids=[3], output_token_ids=[0, 0, 1])
    out = apply_penalties(logits, [row])
    # token 0: seen, positive -> 2/2 = 1, then -0.25*2 - 0.5 = 0.0
    # token 1: seen, negative -> -1*2 = -2, then -0.25 - 0.5 = -2.75
    # token 2: unseen -> 0.5; token 3: prompt only -> 1/2 = 0.5 (no presence/frequency: not generated)
    assert out.tolist() == [[0.0, -2.75, 0.5, 0.5]]


def test_penalties_only_touch_their_row():
    logits = torch.tensor([[2.0, 1.0], [2.0, 1.0]])
    rows = [Row(SamplingParams(frequency_penalty=1.0), output_token_ids=[0]), Row(SamplingParams())]
    assert apply_penalties(logits, rows).tolist() == [[1.0, 1.0], [2.0, 1.0]]


def test_greedy_rows_take_argmax_and_penalties_apply_before():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 4.9]])
    rows = [Row(SamplingParams(temperature=0.0)),
            Row(SamplingParams(temperature=0.0, frequency_penalty=1.0), output_token_ids=[0])]
    assert Sampler()(logits, rows).token_ids == [1, 2]


def empirical(logits: torch.Tensor, params: SamplingParams, n: int = 4000) -> list[float]:
    torch.manual_seed(0)
    rows = [Row(params)] * n
    tokens = Sampler()(logits.repeat(n, 1), rows).token_ids
    return [tokens.count(t) / n for t in range(logits.shape[-1])]


def assert_close_freq(freq: list[float], expected: list[float], n: int = 4000) -> None:
    for f, p in zip(freq, expected, strict=True):
        tol = 4 * math.sqrt(max(p * (1 - p), 1e-4) / n) + 1e-3
        assert abs(f - p) <= tol, (freq, expected)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(temperature):
    logits = logits_of(PROBS)
    expected = (logits[0] / temperature).softmax(-1).tolist()
    assert_close_freq(empirical(logits, SamplingParams(temperature=temperature)), expected)


def test_top_k_top_p_min_p_sample_only_the_kept_tokens_renormalised():
    logits = logits_of(PROBS)
    assert_close_freq(empirical(logits, SamplingParams(top_k=2)), [0.625, 0.375, 0, 0])
    assert_close_freq(empirical(logits, SamplingParams(top_p=0.8)), [0.625, 0.375, 0, 0])
    assert_close_freq(empirical(logits, SamplingParams(min_p=0.2)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    torch.manual_seed(123)
    logits = torch.randn(6, 50)

    def run(position: int, batch: int) -> list[int]:
        gen = make_generator(7, 0, "cpu")
        seq = []
        for step in range(5):
            rows = [Row(SamplingParams()) for _ in range(batch)]
            rows[position] = Row(SamplingParams(seed=7), generator=gen)
            batch_logits = torch.randn(batch, 50)
            batch_logits[position] = logits[step]
            seq.append(Sampler()(batch_logits, rows).token_ids[position])
        return seq

    alone = run(0, 1)
    assert run(3, 5) == alone
    assert run(1, 8) == alone
    other = [Sampler()(logits[s:s + 1], [Row(SamplingParams(), generator=make_generator(8, 0, "cpu"))])
             .token_ids[0] for s in range(5)]
    assert other != alone  # another seed, another stream


def test_choices_of_one_seed_get_distinct_streams():
    assert make_generator(5, 0, "cpu").initial_seed() != make_generator(5, 1, "cpu").initial_seed()
    assert make_generator(5, 1, "cpu").initial_seed() == make_generator(5, 1, "cpu").initial_seed()


def test_logprobs_are_model_logprobs_of_sampled_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    rows = [Row(SamplingParams(temperature=0.0, logprobs=2)), Row(SamplingParams(temperature=0.0))]
    out = Sampler()(logits, rows)
    ref = logits.log_softmax(-1)
    assert out.token_ids == [1, 2]
    assert out.logprobs == pytest.approx([ref[0, 1].item(), ref[1, 2].item()])
    assert out.top_ids[0] == [1, 2]
    assert out.top_logprobs[0] == pytest.approx([ref[0, 1].item(), ref[0, 2].item()])


def test_no_logprobs_when_nobody_asks():
    out = Sampler()(torch.randn(3, 10), [Row(SamplingParams())] * 3)
    assert out.logprobs is None and out.top_ids is None


def test_mixed_batch_greedy_rows_argmax_and_sampled_rows_unchanged():
    """Greedy rows (temperature 0, or one that is 0 in fp32) take argmax; a seeded row beside them draws
    the same token as alone, top_p/min_p of the other rows notwithstanding."""
    torch.manual_seed(3)
    logits = torch.randn(4, 40)
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    rows = [Row(SamplingParams(temperature=0.0)), Row(seeded, generator=make_generator(11, 0, "cpu")),
            Row(SamplingParams(temperature=1e-46, top_k=3)), Row(SamplingParams(temperature=0.0, min_p=0.5))]
    tokens = Sampler()(logits, rows).token_ids
    assert [tokens[0], tokens[2], tokens[3]] == logits[[0, 2, 3]].argmax(-1).tolist()
    alone = Sampler()(logits[1:2], [Row(seeded, generator=make_generator(11, 0, "cpu"))]).token_ids
    assert tokens[1] == alone[0]
