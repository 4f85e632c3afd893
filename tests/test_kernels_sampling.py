"""The sort-free sampling kernel (kernels/sampling.py) vs a float64 reference of the filtered set: support
over a parameter grid, distributions, determinism per (key, counter), extremes, the Sampler's use of it. CPU
runs the interpreter (~2 ms per reduction and helper call, so rows stay few and short); `-m gpu` checks
V = 128256 against the torch sorted path and under CUDA-graph replay."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.sampling import sample_logits
from kernels.sampling_reference import filtered_sets as reference_sets
from server.engine.bias_table import bias_entries
from server.engine.sampler import (
    BIAS,
    LOGPROBS,
    SAMPLED,
    TOP,
    Sampler,
    row_fields,
    step_flags,
    uniform,
)
from server.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MASKED = float("-inf")


def draw(logits, temperature, top_p, top_k, min_p, keys, counters):
    """Kernel tokens (S,); per-row parameters as sequences (or scalars for every row)."""
    S, dev = logits.shape[0], logits.device

    def col(v, dtype):
        return torch.as_tensor(v, dtype=dtype, device=dev).expand(S).contiguous()

    return sample_logits(logits, col(temperature, torch.float32), col(top_p, torch.float32),
                         col(min_p, torch.float32), col(top_k, torch.int64), col(keys, torch.int64),
                         col(counters, torch.int64), GREEDY_TEMPERATURE)


def kinds(V: int, gen: torch.Generator) -> torch.Tensor:
    """(4, V) rows: peaked, near-flat, a third masked with -inf, and heavy ties (logits in steps of 0.5)."""
    peaked = torch.randn(V, generator=gen) * 4
    flat = torch.randn(V, generator=gen) * 0.01
    masked = torch.randn(V, generator=gen) * 2
    masked[torch.randperm(V, generator=gen)[: V // 3]] = MASKED
    ties = (torch.randn(V, generator=gen) * 2).round() / 2
    return torch.stack([peaked, flat, masked, ties])


@interpreter_only
def test_tokens_stay_in_the_filtered_set_over_the_grid():
    V = 40  # two 32-wide tiles per pass, three 16-wide ones per top-k search pass
    gen = torch.Generator().manual_seed(0)
    combos = [(tp, tk, mp) for tp in (1.0, 0.9, 0.5, 1e-6) for tk in (0, 1, 5, V - 1) for mp in (0.0, 0.1)]
    rows = kinds(V, gen)
    # (2 * combos, V): two kinds a combo, rotating, so each kind meets every (top_p, top_k) pair
    which = torch.tensor([[c % 4, (c + 1 + c // 8) % 4] for c in range(len(combos))]).flatten()
    logits = rows[which]
    tp, tk, mp = (torch.tensor([c[i] for c in combos]).repeat_interleave(2) for i in range(3))
    temperature = torch.tensor([0.7, 1.3]).repeat(len(combos))
    tokens = draw(logits, temperature, tp, tk, mp, torch.arange(logits.shape[0]), 5)
    kept, allowed = reference_sets(logits, temperature, tp, tk, mp)
    bad = torch.nonzero(~allowed.gather(1, tokens[:, None]).squeeze(1)).flatten().tolist()
    assert not bad, [(combos[i // 2], int(which[i]), int(tokens[i])) for i in bad]
    assert (kept.sum(-1) > 1).sum() > 20  # the grid is not mostly single-token sets


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of counts against probs; a count where probs is 0 makes it infinite."""
    n = counts.sum()
    expected = probs * n
    if (counts[probs == 0] > 0).any():
        return float("inf")
    live = probs > 0
    return float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())


PROBS = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05])
# (top_k, top_p, min_p, temperature) -> the filtered distribution, and one a wrong filter gives:
DISTRIBUTIONS = [
    # top_k 5 keeps mass 0.87; top_p 0.7 of that (0.609) keeps 0.3, 0.2, 0.15. The unrenormalised top-p
    # (0.7 of the whole mass) would also keep 0.12, drawn ~16% of the time.
    ((5, 0.7, 0.0, 1.0), [0.3, 0.2, 0.15, 0, 0, 0, 0], [0.3, 0.2, 0.15, 0.12, 0, 0, 0]),
    # T = 0.5 squares the probabilities (0.09, 0.04, 0.0225, ...); min_p 0.2 of the best keeps the first
    # three; min-p before the temperature (p >= 0.2 * 0.3) would keep six.
    ((0, 1.0, 0.2, 0.5), [0.09, 0.04, 0.0225, 0, 0, 0, 0], [0.09, 0.04, 0.0225, 0.0144, 0.01, 0.0064, 0]),
]


@interpreter_only
@pytest.mark.parametrize("params, right, wrong", DISTRIBUTIONS)
def test_draws_follow_the_filtered_distribution(params, right, wrong):
    """120 rows of the same logits and distinct keys. 16.3 is chi-square's 0.1% tail at 3 degrees of
    freedom; with the keys fixed the test is deterministic, and the same counts fail the wrong filter's
    distribution (asserted), so a kernel sampling it would fail here."""
    top_k, top_p, min_p, temperature = params
    n = 120
    logits = PROBS.log().repeat(n, 1)
    tokens = draw(logits, temperature, top_p, top_k, min_p, torch.arange(n) * 7919 + 1, 0)
    counts = torch.bincount(tokens, minlength=len(PROBS)).double()
    right, wrong = torch.tensor(right, dtype=torch.float64), torch.tensor(wrong, dtype=torch.float64)
    assert chi_square(counts, right / right.sum()) < 16.3, counts
    assert chi_square(counts, wrong / wrong.sum()) > 16.3, counts


@interpreter_only
def test_a_row_depends_on_its_key_and_counter_alone():
    gen = torch.Generator().manual_seed(3)
    V = 40
    row = torch.randn(V, generator=gen) * 2
    alone = [int(draw(row[None], 0.9, 0.9, 8, 0.0, 12345, c)) for c in range(3)]
    for c in range(3):  # position 2 of 4, neighbours with other logits and parameters
        logits = torch.randn(4, V, generator=gen) * 3
        logits[2] = row
        out = draw(logits, [1.0, 0.5, 0.9, 0.0], [0.5, 1.0, 0.9, 1.0], [0, 3, 8, 0], [0.1, 0.0, 0.0, 0.0],
                   [1, 2, 12345, 4], [7, c, c, 0])
        assert int(out[2]) == alone[c]
        assert int(out[3]) == int(logits[3].argmax())  # the greedy neighbour takes its argmax
    assert len(set(alone)) > 1  # the counter moves the draw


@interpreter_only
def test_round_zero_uses_the_torch_uniform():
    """With nothing filtered, round 0's inverse-CDF draw is the torch path's draw from the same uniform."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(40, 40, generator=gen)
    keys, counters = torch.arange(40) * 31 + 2, torch.arange(40) % 3
    tokens = draw(logits, 1.0, 1.0, 0, 0.0, keys, counters)
    probs = (logits - logits.max(-1, keepdim=True).values).exp()
    cdf = probs.cumsum(-1)
    expected = torch.searchsorted(cdf, (uniform(keys, counters)[:, None] * cdf[:, -1:]), right=True)
    assert (tokens == expected.squeeze(1)).sum() >= 39  # a uniform within rounding of a CDF step may differ


@interpreter_only
def test_tiny_top_p_keeps_only_the_argmax_and_extremes_stay_finite():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 40, generator=gen) * torch.tensor([0.01, 3.0]).repeat(6)[:, None]
    top_p = torch.tensor([1e-6, 1e-46]).repeat_interleave(6)  # 1e-46 is 0 in fp32
    assert draw(logits, 1.0, top_p, 0, 0.0, torch.arange(12), 1).tolist() == logits.argmax(-1).tolist()

    x = torch.randn(5, 40, generator=gen)
    x[0] = MASKED                              # all masked: token 0, as torch's argmax
    x[1, :20] = float("nan")                   # NaN is never drawn
    x[2, 9] = float("inf")                     # +inf is the largest logit
    x[3, 30:] = MASKED                         # a huge temperature flattens the rest, masked stay out
    x[4, 17] = 1e30
    out = draw(x, [1.0, 1.0, 1.0, 3e38, 1.0], 0.9, 0, 0.0, torch.arange(5), 0).tolist()
    assert out[0] == 0 and 20 <= out[1] < 40 and out[2] == 9 and out[3] < 30 and out[4] == 17


@interpreter_only
def test_sampler_with_the_kernel_advances_counts_and_keeps_logprobs():
    V = 40
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0, top_k=3, min_p=0.05)]
    s = Sampler(3, V, torch.device("cpu"), kernel=True)
    fields = [row_fields(p, 100 + i, 0) for i, p in enumerate(params)]
    s.init_rows(torch.arange(3), torch.tensor([f for f, _ in fields]), torch.tensor([i for _, i in fields]))
    flags = step_flags(params[0]) | step_flags(params[1]) | step_flags(params[2])
    assert flags & TOP and flags & SAMPLED
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6)) * 3
    firsts = []
    for step in range(2):
        out = s(logits, torch.arange(3), flags, num_logprobs=2)
        tokens = out.token_ids
        assert s.ints[:3, 2].tolist() == [step + 1] * 3
        assert int(tokens[1]) == int(logits[1].argmax())
        _, allowed = reference_sets(logits, [0.8, 1.0, 1.0], [0.9, 1.0, 1.0], [0, 0, 3], [0.0, 0.0, 0.05])
        assert allowed.gather(1, tokens[:, None]).all()
        assert out.logprobs.tolist() == pytest.approx(logits.log_softmax(-1).gather(1, tokens[:, None])
                                                      .squeeze(1).tolist(), abs=1e-5)
        firsts.append(tokens.tolist())
    again = Sampler(3, V, torch.device("cpu"), kernel=True)  # same seeds and counts: same tokens
    again.init_rows(torch.arange(3), torch.tensor([f for f, _ in fields]),
                    torch.tensor([i for _, i in fields]))
    assert again(logits, torch.arange(3), flags).token_ids.tolist() == firsts[0]


@interpreter_only
def test_sampler_draws_from_model_dtype_logits_what_it_draws_from_their_fp32_copy():
    """A step without penalties, logprobs or compact rows hands the kernel the model's fp16 logits (no fp32
    copy): the kernel widens them as it loads them, so every row draws the token the copy gives; a step
    asking for logprobs still gets fp32 logits (the raw row it returns)."""
    V = 40
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, min_p=0.05, seed=4)]
    fields = [row_fields(p, 100 + i, 0) for i, p in enumerate(params)]
    flags = step_flags(params[0]) | step_flags(params[1]) | step_flags(params[2])
    logits = (torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 3).half()
    tokens = []
    for x in (logits, logits.float()):
        s = Sampler(3, V, torch.device("cpu"), kernel=True)
        s.init_rows(torch.arange(3), torch.tensor([f for f, _ in fields]),
                    torch.tensor([i for _, i in fields]))
        assert s.reads_model_dtype(flags, None) and not s.reads_model_dtype(flags | LOGPROBS, None)
        tokens.append([s(x, torch.arange(3), flags).token_ids.tolist() for _ in range(4)])
    assert tokens[0] == tokens[1]
    assert not Sampler(3, V, torch.device("cpu"), kernel=False).reads_model_dtype(flags, None)


def test_wrapper_checks_shapes_and_dtypes():
    logits = torch.zeros(2, 8)
    f, i = torch.ones(2), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="logits must be"):
        sample_logits(logits.double(), f, f, f, i, i, i, 1e-5)
    with pytest.raises(ValueError, match="unit stride"):
        sample_logits(torch.zeros(8, 2).t(), f, f, f, i, i, i, 1e-5)
    with pytest.raises(ValueError, match="top_k must be"):
        sample_logits(logits, f, f, f, i.int(), i, i, 1e-5)
    with pytest.raises(ValueError, match="temperature must be"):
        sample_logits(logits, torch.ones(3), f, f, i, i, i, 1e-5)
    assert sample_logits(torch.zeros(0, 8), f[:0], f[:0], f[:0], i[:0], i[:0], i[:0], 1e-5).shape == (0,)


# ---- GPU: the bench model's vocabulary, against the torch sorted path
GPU_V, GPU_S = 128256, 64
GPU_CONFIGS = [(0.8, 0.95, 0, 0.0), (1.0, 0.9, 50, 0.0), (0.7, 1.0, 0, 0.05), (1.0, 0.5, 1000, 0.02),
               (1.2, 1e-6, 0, 0.0), (0.0, 1.0, 0, 0.0)]  # (temperature, top_p, top_k, min_p)


def gpu_logits(dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(GPU_S, GPU_V, generator=gen, device="cuda") * 3
    x[:, -256:] = MASKED  # masked ids, as the presets have
    return x.to(dtype)


def sorted_path(logits, t, tp, tk, mp, counters):
    """Tokens of the torch path (Sampler(kernel=False)) for rows of one parameter set."""
    S = logits.shape[0]
    p = SamplingParams(temperature=t, top_p=tp, top_k=tk, min_p=mp)
    s = Sampler(S, logits.shape[1], logits.device, kernel=False)
    fields = [row_fields(p, 1000 + r, counters) for r in range(S)]
    s.init_rows(torch.arange(S, device="cuda"), torch.tensor([f for f, _ in fields], device="cuda"),
                torch.tensor([i for _, i in fields], device="cuda"))
    return s(logits.float(), torch.arange(S, device="cuda"), step_flags(p)).token_ids


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_gpu_kernel_support_matches_the_sorted_path(dtype, config):
    t, tp, tk, mp = config
    logits = gpu_logits(dtype, seed=tk + int(tp * 100))
    keys = torch.arange(GPU_S, device="cuda") + 1000
    kept, allowed = reference_sets(logits, t if t > 0 else 1.0, tp, tk, mp)
    for counter in range(4):
        tokens = draw(logits, t, tp, tk, mp, keys, counter)
        assert allowed.gather(1, tokens[:, None]).all(), config
        torch_tokens = sorted_path(logits, t, tp, tk, mp, counter)
        assert allowed.gather(1, torch_tokens[:, None]).all(), config  # the reference is the torch semantics
        best = logits.float().max(-1).values
        if t == 0.0:
            assert torch.equal(tokens, logits.float().argmax(-1)), config
        if tp < 1e-3:  # a max tied in bf16 may be any of the ties
            assert torch.equal(logits.float().gather(1, tokens[:, None]).squeeze(1), best), config


def bucket_counts(tokens, row_p, kept, buckets=8):
    """Counts of tokens per bucket of the kept set, bucketed by the kept mass above each token (so each
    bucket's probability is known exactly), and those probabilities."""
    p = torch.where(kept, row_p, 0.0)
    order = p.argsort(descending=True)
    cum = p[order].cumsum(0) / p.sum()
    bucket_of = torch.empty_like(order)
    bucket_of[order] = ((cum - p[order] / p.sum()) * buckets).long().clamp(max=buckets - 1)
    probs = torch.zeros(buckets, dtype=torch.float64, device=p.device).index_add_(0, bucket_of, p / p.sum())
    return torch.bincount(bucket_of[tokens], minlength=buckets).double(), probs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [(0.8, 0.95, 0, 0.0), (1.0, 0.9, 50, 0.0)])
def test_gpu_distribution_matches_the_filtered_one(config):
    """4096 draws of one row (64 keys x 64 counters) by the kernel and by the sorted path, both against the
    exact bucket probabilities (26.1: chi-square's 0.05% tail at 7 degrees of freedom)."""
    t, tp, tk, mp = config
    row = gpu_logits(torch.float32, seed=11)[:1].expand(GPU_S, GPU_V).contiguous()
    kept, _ = reference_sets(row[:1], t, tp, tk, mp)
    x = row[0].double()
    row_p = ((x - x.max()) / t).exp()
    keys = torch.arange(GPU_S, device="cuda") * 7919 + 3
    ours = torch.cat([draw(row, t, tp, tk, mp, keys, c) for c in range(64)])
    theirs = torch.cat([sorted_path(row, t, tp, tk, mp, c) for c in range(64)])
    for tokens in (ours, theirs):
        counts, probs = bucket_counts(tokens, row_p, kept[0])
        assert chi_square(counts.cpu(), probs.cpu()) < 26.1, (counts, probs)


@pytest.mark.gpu
@needs_cuda
def test_gpu_kernel_replays_in_a_cuda_graph():
    logits = gpu_logits(torch.float32, seed=2)
    counters = torch.zeros(GPU_S, dtype=torch.int64, device="cuda")
    eager = draw(logits, 0.8, 0.9, 50, 0.0, torch.arange(GPU_S, device="cuda"), counters)  # compiles it
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_logits(logits, torch.full((GPU_S,), 0.8, device="cuda"),
                            torch.full((GPU_S,), 0.9, device="cuda"), torch.zeros(GPU_S, device="cuda"),
                            torch.full((GPU_S,), 50, dtype=torch.int64, device="cuda"),
                            torch.arange(GPU_S, device="cuda"), counters, GREEDY_TEMPERATURE)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    counters += 1  # a replay reads the counters it was captured over: the next draw differs somewhere
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, eager)


@interpreter_only
def test_compact_top_k_rows_draw_from_their_best_tokens_whatever_their_neighbours(monkeypatch):
    """Rows with 0 < top_k <= COMPACT_TOP_K draw over their best COMPACT_TOP_K tokens (shrunk to 16 here so
    that V = 64 holds more): tokens stay in the exact filtered set, and a row draws the same token alone or
    beside rows that take the whole-row path."""
    import server.engine.sampler as sampler_mod
    monkeypatch.setattr(sampler_mod, "COMPACT_TOP_K", 16)
    V = 64
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(3, V, generator=gen) * 2
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie at the top of the compact row
    params = [SamplingParams(temperature=0.9, top_k=7, top_p=0.8), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.7, top_k=12, min_p=0.05)]
    compact = torch.tensor([i for i, p in enumerate(params) if sampler_mod.draws_from_best(p)])
    assert compact.tolist() == [0, 2]
    fields = [row_fields(p, 500 + i, 0) for i, p in enumerate(params)]
    floats, ints = torch.tensor([f for f, _ in fields]), torch.tensor([i for _, i in fields])
    flags = step_flags(params[0]) | step_flags(params[1]) | step_flags(params[2])

    def sample(rows, comp, logits_rows):
        s = Sampler(3, V, torch.device("cpu"), kernel=True)
        s.init_rows(torch.arange(len(rows)), floats[rows], ints[rows])
        return s(logits_rows, torch.arange(len(rows)), flags, compact=comp).token_ids.tolist()

    together = sample([0, 1, 2], compact, logits)
    _, allowed = reference_sets(logits, [0.9, 1.0, 0.7], [0.8, 0.5, 1.0], [7, 0, 12], [0.0, 0.0, 0.05])
    assert all(allowed[r, t] for r, t in enumerate(together))
    assert sample([0], torch.tensor([0]), logits[:1]) == together[:1]
    assert sample([2], torch.tensor([0]), logits[2:]) == together[2:]
    assert sample([1], None, logits[1:2]) == together[1:2]  # the whole-row path ignores the others too


def init_biased_rows(s: Sampler, params: list[SamplingParams], held_back: list[int], device="cpu") -> None:
    fields = [row_fields(p, 700 + r, 0) for r, p in enumerate(params)]
    rows = torch.arange(len(params), device=device)
    s.init_rows(rows, torch.tensor([f for f, _ in fields], device=device),
                torch.tensor([i for _, i in fields], device=device))
    entries = [(r, c, t, v, h) for r, p in enumerate(params)
               for c, (t, v, h) in enumerate(zip(*bias_entries(p, held_back), strict=True))]
    r, c, t, v, h = (torch.tensor(x, device=device) for x in zip(*entries, strict=True))
    s.bias.write(r, c, t, v.float(), h, max(int(c.max()) + 1, 1))


@interpreter_only
def test_the_kernel_draws_from_biased_logits_and_reports_the_raw_logprobs():
    """Greedy, whole-row and compact top-k draws through the kernel, each row with a bias that forces a
    token (row 2 at first: min_tokens holds its forced EOS back for one sample); the logprobs stay the
    model's."""
    V, eos = 40, 2
    params = [SamplingParams(temperature=0.0, logit_bias={11: 100.0}, logprobs=1),
              SamplingParams(temperature=0.9, top_p=0.9, logit_bias={12: 100.0}),
              SamplingParams(temperature=0.8, top_k=4, logit_bias={eos: 100.0, 13: 60.0}, min_tokens=1)]
    s = Sampler(3, V, torch.device("cpu"), kernel=True)
    init_biased_rows(s, params, [eos])
    flags = step_flags(params[0]) | step_flags(params[1]) | step_flags(params[2])
    assert flags & BIAS and not s.reads_model_dtype(flags, None)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(9)) * 3
    compact = torch.tensor([2])
    first = s(logits, torch.arange(3), flags, num_logprobs=1, compact=compact)
    assert first.token_ids.tolist() == [11, 12, 13]
    assert first.logprobs[0].item() == pytest.approx(logits[0].log_softmax(-1)[11].item(), abs=1e-5)
    second = s(logits, torch.arange(3), flags, num_logprobs=1, compact=compact)
    assert second.token_ids.tolist() == [11, 12, eos]
    # allowed tokens the model masks (-inf): the kernel draws among them, greedy and sampled
    masked = [SamplingParams(temperature=t, allowed_token_ids=[20, 21]) for t in (0.0, 1.0)]
    s = Sampler(2, V, torch.device("cpu"), kernel=True)
    init_biased_rows(s, masked, [eos])
    logits[:2, 20:22] = float("-inf")
    drawn = s(logits[:2], torch.arange(2), step_flags(masked[0]) | step_flags(masked[1])).token_ids
    assert all(t in (20, 21) for t in drawn.tolist())


@interpreter_only
def test_warm_up_draws_nothing_and_changes_no_row():
    s = Sampler(2, 40, torch.device("cpu"), kernel=True)
    before = (s.floats.clone(), s.ints.clone())
    s.warm_up()
    assert torch.equal(s.floats, before[0]) and torch.equal(s.ints, before[1])


@pytest.mark.gpu
@needs_cuda
def test_gpu_sampled_steps_compile_nothing_after_warm_up():
    """Whole-row and compact top-k draws at several batch sizes after warm_up: no Triton compile (one
    mid-serving compile stalls every stream)."""
    import triton
    V, compiles = 128256, []
    s = Sampler(64, V, torch.device("cuda"), kernel=True)
    s.warm_up(torch.bfloat16)
    torch.cuda.synchronize()
    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kw: compiles.append(kw.get("repr"))
    try:
        for S, params in ((1, SamplingParams(temperature=0.8, top_p=0.95)), (37, SamplingParams(top_k=50)),
                          (64, SamplingParams(temperature=0.7, top_k=5, min_p=0.1))):
            fields = [row_fields(params, r, 0) for r in range(S)]
            rows = torch.arange(S, device="cuda")
            s.init_rows(rows, torch.tensor([f for f, _ in fields], device="cuda"),
                        torch.tensor([i for _, i in fields], device="cuda"))
            logits = torch.randn(S, V, device="cuda") * 3
            compact = rows if params.top_k else None
            s(logits, rows, step_flags(params), compact=compact)
            if compact is None:  # a decode graph's bf16 logits, drawn from as they are
                s(logits.bfloat16(), rows, step_flags(params))
        # biased rows (greedy, whole-row and compact draws) read the fp32 logits: forced tokens come out
        biased = [SamplingParams(temperature=0.0, logit_bias={500: 100.0}),
                  SamplingParams(temperature=0.8, top_p=0.95, logit_bias={501: 100.0}),
                  SamplingParams(temperature=0.7, top_k=50, logit_bias={502: 50.0, 2: 100.0}, min_tokens=3),
                  SamplingParams(temperature=1.0, allowed_token_ids=[7, 8])]
        init_biased_rows(s, biased, [2], "cuda")
        flags = 0
        for params in biased:
            flags |= step_flags(params)
        logits = torch.randn(4, V, device="cuda") * 3
        rows = torch.arange(4, device="cuda")
        tokens = [s(logits, rows, flags, compact=rows[2:3]).token_ids.tolist() for _ in range(4)]
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert compiles == []
    assert [t[:3] for t in tokens] == [[500, 501, 502]] * 3 + [[500, 501, 2]]
    assert {t[3] for t in tokens} <= {7, 8}
