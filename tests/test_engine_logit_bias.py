"""logit_bias and min_tokens in the engine: whole engines (preemption and resume, forks, rows reused by
requests without biases, async scheduling on and off, eager and static-graph steps) token by token against
a dense greedy reference that biases the logits itself; and the sampler's bias table (rows reused, the
table widening, the sample count min_tokens reads on greedy steps)."""

from __future__ import annotations

import pytest
import torch

from server.engine.bias_table import bias_entries
from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.sampler import ALLOW, BIAS, LOGPROBS, Sampler, row_fields, step_flags
from server.engine.sampling_params import SamplingParams
from server.model.tokenizer import ByteTokenizer
from tests.test_engine_out_rows import last_logits, run_engine

EOS = ByteTokenizer.EOS
PRINTABLE = range(ByteTokenizer.OFFSET + 32, ByteTokenizer.OFFSET + 127)  # never masked by the tiny preset


def dense_biased(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy through the contiguous forward with the request's logit_bias added and, while fewer than
    min_tokens are out, EOS and the stop ids at -inf; ends as the core ends a choice."""
    ids, out = list(prompt), []
    held = set(params.stop_token_ids) | ({EOS} if not params.ignore_eos else set())
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = last_logits(model, ids)
            if params.allowed_token_ids is not None:
                keep = torch.zeros_like(logits, dtype=torch.bool)
                keep[params.allowed_token_ids] = True
                logits = logits.masked_fill(~keep, float("-inf"))
            for token, value in params.logit_bias.items():
                logits[token] += value
            if len(out) < params.min_tokens:
                logits[list(held)] = float("-inf")
            t = int(logits.argmax())
            ids.append(t)
            out.append(t)
            if t in params.stop_token_ids or (t == EOS and not params.ignore_eos):
                break
    return out


def requests():
    gen = torch.Generator().manual_seed(7)
    biased = torch.tensor(PRINTABLE)[torch.randperm(len(PRINTABLE), generator=gen)[:12]].tolist()
    reqs = []
    for i, n_tok in enumerate([21, 6, 14, 3, 18, 9, 11, 5]):
        prompt = torch.randint(3, 250, (n_tok,), generator=gen).tolist()
        bias, min_tokens, stop_ids = {}, 0, []
        if i % 4 == 0:  # small biases that move some argmaxes
            bias = {t: float(torch.empty(()).uniform_(-4, 4, generator=gen)) for t in biased[i:i + 6]}
        if i % 4 == 1:  # EOS pushed up, held back until min_tokens
            bias, min_tokens = {EOS: 30.0}, 3 + i % 3
        if i == 2:  # a stop id pushed up, held back until min_tokens
            bias, min_tokens, stop_ids = {biased[0]: 40.0}, 4, [biased[0]]
        allowed = None
        if i in (3, 4):  # a few tokens allowed (row 4 with EOS among them, held back, and a bias)
            allowed = biased[6:10] + ([EOS] if i == 4 else [])
        params = SamplingParams(max_tokens=9, temperature=0.0, n=2 if i in (1, 4) else 1, logit_bias=bias,
                                min_tokens=min_tokens, stop_token_ids=stop_ids, allowed_token_ids=allowed)
        reqs.append((f"r{i}", prompt, params))
    return reqs


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("static_graphs", [False, True])
def test_engine_tokens_equal_the_dense_biased_reference(static_graphs, async_scheduling):
    config = EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=4, num_blocks=12,
                          max_num_seqs=6, max_num_batched_tokens=20, attention_backend="torch",
                          async_scheduling=async_scheduling)
    reqs = requests()
    tokens, _, stats, core, _ = run_engine(config, reqs, static_graphs)
    model = core.runner.model
    ended_by_eos = 0
    for rid, prompt, params in reqs:
        want = dense_biased(model, prompt, params)
        for i in range(params.n):
            assert tokens[(rid, i)] == want, (rid, i, params)
        ended_by_eos += want[-1] == EOS
        if params.min_tokens:
            assert len(want) > params.min_tokens and want[-1] in (EOS, *params.stop_token_ids)
        if params.allowed_token_ids is not None:
            assert set(want) <= set(params.allowed_token_ids)
    assert ended_by_eos >= 2 and stats["preemptions"] > 0  # the cases under test happened
    assert not core.requests and core.kv.num_free_blocks == core.kv.num_blocks - 1  # nothing leaked


def sampler_with(rows_params: list[SamplingParams], vocab: int = 40) -> Sampler:
    sampler = Sampler(max_rows=4, vocab_size=vocab, device=torch.device("cpu"), kernel=False)
    sampler.init_rows(torch.arange(4), torch.zeros(4, 6), torch.zeros(4, 4, dtype=torch.int64))
    for row, params in enumerate(rows_params):
        init_row(sampler, row, params)
    return sampler


def init_row(sampler: Sampler, row: int, params: SamplingParams, held_back: list[int] = (EOS,)) -> None:
    f, i = row_fields(params, 0, 0)
    sampler.init_rows(torch.tensor([row]), torch.tensor([f]), torch.tensor([i]))
    ids, values, held = bias_entries(params, list(held_back))
    if ids:
        sampler.bias.write(torch.tensor([row] * len(ids)), torch.arange(len(ids)), torch.tensor(ids),
                           torch.tensor(values), torch.tensor(held), len(ids))


def test_a_reused_row_keeps_none_of_its_last_owners_biases():
    plain = SamplingParams(temperature=0.0)
    sampler = sampler_with([SamplingParams(temperature=0.0, logit_bias={5: 100.0}), plain])
    logits = torch.zeros(2, 40)
    logits[:, 9] = 1.0
    rows = torch.tensor([0, 1])
    assert sampler(logits, rows, BIAS).token_ids.tolist() == [5, 9]
    init_row(sampler, 0, plain)  # row 0's next owner has no bias, in a step where row 1 has one
    init_row(sampler, 1, SamplingParams(temperature=0.0, logit_bias={7: 100.0}))
    assert sampler(logits, rows, BIAS).token_ids.tolist() == [9, 7]


def test_the_table_widens_and_keeps_the_rows_it_has():
    sampler = sampler_with([SamplingParams(temperature=0.0, logit_bias={3: 50.0})])
    wide = {t: -1.0 for t in range(10, 40)}
    init_row(sampler, 1, SamplingParams(temperature=0.0, logit_bias=wide))
    assert sampler.bias.width >= 30
    logits = torch.zeros(2, 40)
    logits[:, 20] = 0.5
    assert sampler(logits, torch.tensor([0, 1]), BIAS).token_ids.tolist() == [3, 0]


def test_allowed_tokens_keep_their_logits_and_a_padded_token_0_stays_out():
    """Row 0 allows tokens 0 and 9 (token 0 also under the padding entries), row 1 allows 30 and has no
    ALLOWED entry elsewhere; row 2 allows nothing in particular: its logits stay whole."""
    sampler = sampler_with([SamplingParams(temperature=0.0, allowed_token_ids=[0, 9]),
                            SamplingParams(temperature=0.0, allowed_token_ids=[30], logit_bias={31: 1.0}),
                            SamplingParams(temperature=0.0, logit_bias={7: 1.0})])
    logits = torch.zeros(3, 40)
    logits[:, 20] = 5.0
    logits[:, 0] = 1.0
    flags = step_flags(SamplingParams(temperature=0.0, allowed_token_ids=[1], logprobs=1))
    assert flags == BIAS | ALLOW | LOGPROBS
    out = sampler(logits, torch.arange(3), flags, num_logprobs=1)
    assert out.token_ids.tolist() == [0, 30, 20]
    assert out.logprobs.tolist() == pytest.approx(logits.log_softmax(-1)[[0, 1, 2], [0, 30, 20]].tolist())
    logits[0, 0] = -1.0  # now 9 (0.0) beats the allowed token 0, and padding ids never bring 0 back
    assert sampler(logits, torch.arange(3), flags).token_ids.tolist() == [9, 30, 20]


def test_an_allowed_token_the_model_masks_is_still_the_one_drawn():
    """A row whose allowed tokens all have logit -inf (masked by the model, or held back by min_tokens) draws
    among them, never another token (an all -inf row's argmax is token 0)."""
    for temperature in (0.0, 1.0):
        masked = SamplingParams(temperature=temperature, seed=1, allowed_token_ids=[5, 6])
        held = SamplingParams(temperature=temperature, seed=2, allowed_token_ids=[EOS], min_tokens=3)
        sampler = sampler_with([masked, held])
        logits = torch.zeros(2, 40)
        logits[0, 5:7] = float("-inf")
        flags = step_flags(masked) | step_flags(held)
        for _ in range(3):
            tokens = sampler(logits, torch.arange(2), flags).token_ids.tolist()
            assert tokens[0] in (5, 6) and tokens[1] == EOS, temperature


@pytest.mark.parametrize("extra", [dict(temperature=0.0), dict(temperature=1.0, seed=3),
                                   dict(temperature=0.0, repetition_penalty=2.0)])
def test_a_held_back_id_ranks_below_an_allowed_id_the_model_masks(extra):
    """min_tokens holds EOS and the stop ids below every other id, an allowed id the model masks (raised to
    its floor) included: row 0 allows 5 and 7, both masked, and holds 5 back; row 1 allows EOS (finite) and 7
    (masked) and holds EOS back. Before, the hold-back was added to the logits: -3e38 - 1e30 rounded back to
    the floor, and row 1's finite EOS ranked above the floor, so each drew its held-back id (a review). Once
    min_tokens is met, the held-back ids are drawn again; and a held-back id that is all a row has left is
    still drawn, under a repetition penalty too."""
    rows = [SamplingParams(allowed_token_ids=[5, 7], stop_token_ids=[5], min_tokens=2, **extra),
            SamplingParams(allowed_token_ids=[EOS, 7], min_tokens=2, **extra),
            SamplingParams(allowed_token_ids=[EOS], min_tokens=5, **extra)]
    sampler = sampler_with([])
    for row, (params, held_back) in enumerate(zip(rows, [(5, EOS), (EOS,), (EOS,)], strict=True)):
        init_row(sampler, row, params, held_back)
    logits = torch.zeros(3, 40)
    logits[:, 5] = logits[:, 7] = float("-inf")
    logits[:, EOS] = 1.0
    flags = step_flags(rows[0]) | step_flags(rows[1])
    if extra.get("repetition_penalty"):  # each row's output holds its held-back ids: the penalty scales them
        token_rows = torch.tensor([0, 0, 1, 1, 2, 2])
        sampler.init_penalty_rows(torch.arange(3), token_rows, torch.tensor([5, EOS] * 3), torch.ones(6))
    got = [sampler(logits, torch.arange(3), flags).token_ids.tolist() for _ in range(3)]
    assert got[:2] == [[7, 7, EOS]] * 2, got
    assert got[2][0] in (5, 7) and got[2][1:] == [EOS, EOS], got


@pytest.mark.parametrize("bad", [
    dict(logit_bias={10**6: 5.0}), dict(logit_bias={-1: 5.0}), dict(allowed_token_ids=[10**6]),
    dict(min_tokens=1, stop_token_ids=[10**6]), dict(min_tokens=1, stop_token_ids=list(range(1100))),
])
def test_the_core_refuses_bad_sampling_fields_a_client_sends_it(bad):
    """A client of the core alone (no API) sending ids the bias table would index out of range, or a
    min_tokens stop list wider than the table holds: a ValueError for that request, and its neighbour runs
    (accepted, the step's scatter failed every request of the batch; on CUDA a device-side assert)."""
    core, _ = build_core(EngineConfig(model="tiny", device="cpu", dtype="float32", num_blocks=64,
                                      attention_backend="torch"))
    prompt = [1, 72, 105]
    with pytest.raises(ValueError):
        core.add_request(EngineRequest("bad", prompt, SamplingParams(max_tokens=4, **bad), 0.0))
    core.add_request(EngineRequest("good", prompt, SamplingParams(max_tokens=4, temperature=0.0), 0.0))
    updates = [u for _ in range(20) if core.has_work() for u in core.step().updates]
    assert updates[-1].finish_reason == "length" and all(u.error is None for u in updates)


def test_min_tokens_counts_the_samples_of_greedy_steps():
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5)
    assert step_flags(params) & BIAS
    sampler = sampler_with([params])
    logits = torch.zeros(1, 40)
    logits[0, EOS] = 5.0
    logits[0, 11] = 1.0
    got = [sampler(logits, torch.tensor([0]), BIAS).token_ids.item() for _ in range(3)]
    assert got == [11, 11, EOS]  # EOS held back for the first two samples only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_engine_with_graphs_equals_the_dense_biased_reference(async_scheduling):
    """The decode graphs' steps with biased rows take the sampler's path (no in-graph argmax): fp32 on the
    GPU, the sampling kernel and the argmax kernel over the biased logits."""
    config = EngineConfig(model="tiny", device="cuda", dtype="float32", block_size=4, num_blocks=12,
                          max_num_seqs=6, max_num_batched_tokens=20, attention_backend="triton",
                          async_scheduling=async_scheduling)
    reqs = requests()
    tokens, _, stats, core, _ = run_engine(config, reqs)
    assert core.runner.graphs is not None and core.runner.graphs.num_replays > 0 and stats["preemptions"] > 0
    for rid, prompt, params in reqs:
        want = dense_biased(core.runner.model, prompt, params)
        for i in range(params.n):
            assert tokens[(rid, i)] == want, (rid, i, params)


@pytest.mark.parametrize("extra", [dict(temperature=1.0, seed=1), dict(temperature=0.5, seed=1),
                                   dict(temperature=0.0, repetition_penalty=2.0),
                                   dict(temperature=0.7, seed=2, repetition_penalty=1.5)])
def test_a_masked_allowed_id_stays_the_only_one_under_penalties(extra):
    """An allowed id the model masks (-inf; the tiny preset's byte 0x01) is raised to a finite floor; a
    repetition penalty after it multiplied the floor past fp32's range (-inf) once the id was generated,
    and the row drew token 0 (greedy) or any token (sampled). The floor is set again after the penalties
    (a review)."""
    masked = ByteTokenizer.OFFSET + 1
    core, _ = build_core(EngineConfig(model="tiny", device="cpu", dtype="float32", num_blocks=64,
                                      attention_backend="torch"))
    params = SamplingParams(max_tokens=4, ignore_eos=True, allowed_token_ids=[masked], **extra)
    core.add_request(EngineRequest("r", [1, 72, 105], params, 0.0))
    tokens = [t for _ in range(20) if core.has_work() for u in core.step().updates for t in u.new_token_ids]
    assert tokens == [masked] * 4, (extra, tokens)
