"""Sampler unit tests on crafted logits: distributions of the masks, penalties, greedy, extreme values, seeded
rows independent of their neighbours, logprobs; the row state lives in the sampler as in the runner."""

from __future__ import annotations

import math

import pytest
import torch

from server.engine.sampler import (
    Sampler,
    apply_penalties,
    row_fields,
    seed_key,
    step_flags,
    uniform,
)
from server.engine.sampling_params import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]
CPU = torch.device("cpu")


def sampler_for(params: list[SamplingParams], keys: list[int] | None = None, vocab: int = 4) -> Sampler:
    """A sampler whose rows 0..n-1 hold `params` (seed keys 0..n-1 unless given), as the runner
    writes them."""
    n = len(params)
    keys = list(range(n)) if keys is None else keys
    s = Sampler(n, vocab, CPU)
    fields = [row_fields(p, k, 0) for p, k in zip(params, keys, strict=True)]
    floats = torch.tensor([f for f, _ in fields], dtype=torch.float32)
    ints = torch.tensor([i for _, i in fields], dtype=torch.int64)
    s.init_rows(torch.arange(n), floats, ints)
    return s


def sample(s: Sampler, logits: torch.Tensor, params: list[SamplingParams], rows=None, num_logprobs=0):
    rows = torch.arange(len(params)) if rows is None else torch.tensor(rows)
    flags = 0
    for p in params:
        flags |= step_flags(p)
    return s(logits, rows, flags, num_logprobs)


def logits_of(probs: list[float], batch: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(batch, 1)  # (B, V)


def empirical(probs: list[float], params: SamplingParams, n: int = 4000) -> list[float]:
    """Token frequencies over n rows of distinct seed keys, one step."""
    s = sampler_for([params] * n, vocab=len(probs))
    tokens = sample(s, logits_of(probs, n), [params] * n).token_ids.tolist()
    return [tokens.count(t) / n for t in range(len(probs))]


def assert_close_freq(freq: list[float], expected: list[float], n: int = 4000) -> None:
    for f, p in zip(freq, expected, strict=True):
        tol = 4 * math.sqrt(max(p * (1 - p), 1e-4) / n) + 1e-3
        assert abs(f - p) <= tol, (freq, expected)
        assert p > 0 or f == 0, (freq, expected)  # a masked token is never drawn


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(temperature):
    expected = (logits_of(PROBS)[0] / temperature).softmax(-1).tolist()
    assert_close_freq(empirical(PROBS, SamplingParams(temperature=temperature)), expected)


@pytest.mark.parametrize("top_p, expected", [(0.4, [1, 0, 0, 0]), (0.7, [0.625, 0.375, 0, 0]),
                                             (0.81, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
                                             (1.0, PROBS)])
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, expected):
    assert_close_freq(empirical(PROBS, SamplingParams(top_p=top_p)), expected)


def test_top_k_then_top_p_renormalises_after_k_and_min_p_is_relative_to_best():
    assert_close_freq(empirical(PROBS, SamplingParams(top_k=2)), [0.625, 0.375, 0, 0])
    # top_k=2 leaves {0.5, 0.3} -> renormalised 0.625, 0.375; top_p=0.6 then keeps only the first
    assert_close_freq(empirical(PROBS, SamplingParams(top_k=2, top_p=0.6)), [1, 0, 0, 0])
    assert_close_freq(empirical(PROBS, SamplingParams(min_p=0.2)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert_close_freq(empirical(PROBS, SamplingParams(min_p=0.5, top_k=3)), [0.625, 0.375, 0, 0])


def test_top_k_keeps_every_token_tied_with_the_kth():
    # three tokens tie for the best: top_k=2 keeps all three (vLLM's `logits < kth` mask, and the kernel's);
    # the sorted path cut at rank 2 and dropped one of them arbitrarily (a review)
    probs = [0.3, 0.05, 0.3, 0.05, 0.3]
    assert_close_freq(empirical(probs, SamplingParams(top_k=2)), [1 / 3, 0, 1 / 3, 0, 1 / 3])


def test_penalties_math():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0]])  # generated: 0, 0, 1
    in_prompt = torch.tensor([[False, False, False, True]])
    out = apply_penalties(logits, counts, in_prompt, torch.tensor([[0.5, 0.25, 2.0]]))
    # token 0: seen, positive -> 2/2 = 1, then -0.25*2 - 0.5 = 0.0
    # token 1: seen, negative -> -1*2 = -2, then -0.25 - 0.5 = -2.75
    # token 2: unseen -> 0.5; token 3: prompt only -> 1/2 = 0.5 (no presence/frequency: not generated)
    assert out.tolist() == [[0.0, -2.75, 0.5, 0.5]]


def test_penalty_state_is_per_row_and_counts_the_sampled_tokens():
    """Row 0 has a frequency penalty over a generated 0 (counted at init, as after a preemption); it then
    counts its own samples. Row 1 has none and keeps the argmax."""
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=0.0)]
    s = sampler_for(params, vocab=2)
    s.init_penalty_rows(torch.tensor([0]), torch.tensor([0, 0]), torch.tensor([1, 0]), torch.tensor([0, 1]))
    logits = torch.tensor([[2.0, 1.5], [2.0, 1.5]])
    assert sample(s, logits, params).token_ids.tolist() == [1, 0]  # 2 - 1 < 1.5
    assert s.counts[0].tolist() == [1, 1] and s.in_prompt[0].tolist() == [False, True]
    assert sample(s, logits, params).token_ids.tolist() == [0, 0]  # 2 - 1 > 1.5 - 1
    assert s.counts[0].tolist() == [2, 1]


def test_greedy_rows_take_argmax_below_the_temperature_threshold():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 4.9], [1.0, 2.0, 3.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6, top_k=2),
              SamplingParams(temperature=1e-40, min_p=0.5)]
    assert sample(sampler_for(params, vocab=3), logits, params).token_ids.tolist() == [1, 0, 2]


def test_extreme_values_give_finite_valid_tokens():
    """Temperatures that underflow, a top_p that is 0 in fp32, logits at the fp32 limits: valid tokens, no
    NaN, the top token where only it may survive."""
    V = 64
    logits = torch.randn(6, V)
    logits[0, 7] = 3e38
    logits[1] = -3e38
    logits[1, 5] = 3e38
    logits[2, 9] = float("inf")
    logits[3, 11] = 1e30
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=0.7, top_p=1e-46),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1e-5, top_k=V + 10),
              SamplingParams(temperature=2.0, top_p=1e-46, min_p=1.0), SamplingParams(temperature=1e4)]
    s = sampler_for(params, vocab=V)
    for _ in range(3):
        out = sample(s, logits, params, num_logprobs=2).token_ids.tolist()
        assert all(0 <= t < V for t in out)
        assert out[:4] == [7, 5, 9, 11] and out[4] == int(logits[4].argmax())


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    torch.manual_seed(123)
    steps = torch.randn(5, 50)
    key = seed_key(7, 0)

    def run(position: int, batch: int) -> list[int]:
        params = [SamplingParams(top_p=0.9, top_k=20 if i % 2 else 0) for i in range(batch)]
        params[position] = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
        keys = [1000 + i for i in range(batch)]
        keys[position] = key
        s = sampler_for(params, keys, vocab=50)
        seq = []
        for step in range(5):
            logits = torch.randn(batch, 50)
            logits[position] = steps[step]
            seq.append(sample(s, logits, params).token_ids[position].item())
        return seq

    alone = run(0, 1)
    assert run(3, 5) == alone
    assert run(1, 8) == alone
    assert len(set(alone)) > 1  # the counter advances: not one draw repeated


@pytest.mark.parametrize("mine", [SamplingParams(temperature=1.0, seed=8),
                                  SamplingParams(temperature=0.7, min_p=0.05, seed=8)],
                         ids=["plain", "min_p"])
def test_a_row_without_top_filters_draws_the_same_beside_rows_with_them(mine):
    """A neighbour's top_p or top_k sends the whole step down the sorted path on the CPU: the unfiltered
    row's token must be the one it draws alone (the sorted walk of the same uniform picked another)."""
    torch.manual_seed(5)
    steps = torch.randn(6, 300) * 3
    neighbours = {"alone": [], "greedy": [SamplingParams(temperature=0.0)],
                  "top_p": [SamplingParams(temperature=1.0, top_p=0.9)],
                  "top_k": [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.5)]}
    runs = {}
    for name, others in neighbours.items():
        params = [mine, *others]
        s = sampler_for(params, [seed_key(8, 0)] + [99 + i for i in range(len(others))], vocab=300)
        runs[name] = [sample(s, torch.cat([steps[i:i + 1], torch.randn(len(others), 300)]), params)
                      .token_ids[0].item() for i in range(6)]
    assert all(r == runs["alone"] for r in runs.values()), runs
    assert len(set(runs["alone"])) > 1


def test_choices_of_one_seed_get_distinct_streams_and_uniforms_cover_the_unit_interval():
    assert seed_key(5, 0) != seed_key(5, 1) and seed_key(5, 1) == seed_key(5, 1)
    assert all(0 <= seed_key(s, i) < 2**31 for s in (0, 1, 2**62, -3) for i in range(3))
    # every bit of a 64-bit seed counts: seeds apart in their high bits only get different streams
    assert seed_key(5, 0) != seed_key(5 + 2**62, 0) and seed_key(-3, 0) != seed_key(-3 + 2**62, 0)
    assert len({seed_key(s << 40, 0) for s in range(1000)}) == 1000
    u = uniform(torch.full((20000,), 9), torch.arange(20000))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert len(set(u.tolist())) > 19000


def test_logprobs_are_model_logprobs_of_sampled_and_top():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0)]
    out = sample(sampler_for(params), logits, params, num_logprobs=2)
    ref = logits.log_softmax(-1)
    assert out.token_ids.tolist() == [1, 2]
    assert out.logprobs.tolist() == pytest.approx([ref[0, 1].item(), ref[1, 2].item()])
    assert out.top_ids[0].tolist() == [1, 2]
    assert out.top_logprobs[0].tolist() == pytest.approx([ref[0, 1].item(), ref[0, 2].item()])


def test_no_logprobs_when_nobody_asks():
    params = [SamplingParams()] * 3
    out = sample(sampler_for(params, vocab=10), torch.randn(3, 10), params)
    assert out.logprobs is None and out.top_ids is None


def test_rows_are_addressed_by_batch_row_not_position():
    """The step's rows are any subset of the persistent rows, in any order."""
    params = [SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    s = sampler_for(params, vocab=3)
    s.init_penalty_rows(torch.tensor([2]), torch.tensor([2]), torch.tensor([0]), torch.tensor([1]))
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    out = sample(s, logits, [params[2], params[0]], rows=[2, 0])
    assert out.token_ids.tolist() == [1, 0]  # row 0 draws from its one best token
    assert s.ints[:, 2].tolist()[:3] == [1, 0, 1]  # sample counts advanced for rows 2 and 0 only


def test_a_step_that_draws_nothing_leaves_the_draw_counts():
    """The counts are the seeded draws' Philox offsets: greedy rows never read theirs, so an all-greedy
    step skips the update (two launches a step), and a sampled row's count still counts its draws."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=5)]
    s = sampler_for(params, vocab=4)
    logits = torch.randn(2, 4)
    sample(s, logits[:1], params[:1], rows=[0])
    assert s.ints[:, 2].tolist()[:2] == [0, 0]
    sample(s, logits, params, rows=[0, 1])
    sample(s, logits[1:], params[1:], rows=[1])
    assert s.ints[:, 2].tolist()[:2] == [1, 2]


def test_penalty_rows_count_outputs_and_mask_prompts_with_repeats_and_resets():
    """A token in both the prompt and the output of one row, repeated: the counts hold the output
    occurrences only, the mask the prompt ones only; taking a row again clears what it held."""
    s = Sampler(2, 5, torch.device("cpu"))  # rows 0..2 (the last one padding)
    rows = torch.tensor([0, 2])
    token_rows = torch.tensor([0, 0, 0, 0, 2, 2, 2])
    token_ids = torch.tensor([3, 3, 3, 1, 4, 4, 0])
    is_output = torch.tensor([0, 1, 1, 0, 1, 0, 0])
    for _ in range(2):  # the second init of the same rows must give the same state, not twice the counts
        s.init_penalty_rows(rows, token_rows, token_ids, is_output)
        assert s.counts.tolist() == [[0, 0, 0, 2, 0], [0] * 5, [0, 0, 0, 0, 1]]
        assert s.in_prompt.tolist() == [[False, True, False, True, False], [False] * 5,
                                        [True, False, False, False, True]]
    s.init_penalty_rows(torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), torch.tensor([1]))
    assert s.counts[0].tolist() == [0, 0, 1, 0, 0] and not s.in_prompt[0].any()
    assert s.counts[2].tolist() == [0, 0, 0, 0, 1]  # rows not re-taken keep their state
