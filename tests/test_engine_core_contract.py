"""The engine core's own guarantees to any client (the API refuses most of these first; a client of the
core alone does not): every choice of a request gets a finish, and a request the core can never run is
refused alone instead of failing the batch it would join."""

from __future__ import annotations

import pytest

from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.sampling_params import SamplingParams

TINY = dict(model="tiny", dtype="float32", device="cpu", attention_backend="torch", block_size=4,
            num_blocks=64, max_num_seqs=6, max_num_batched_tokens=8, max_model_len=64)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def core(request):
    core, _ = build_core(EngineConfig(**TINY, async_scheduling=request.param))
    return core


def run(core, max_steps: int = 500) -> dict[tuple[str, int], str]:
    finish = {}
    for _ in range(max_steps):
        if not core.has_work():
            return finish
        for u in core.step().updates:
            if u.finish_reason is not None:
                finish[(u.request_id, u.index)] = u.finish_reason
    raise AssertionError("no progress")


def test_aborting_a_prefilling_parent_finishes_the_choices_waiting_to_fork(core):
    """n = 3: choices 1 and 2 fork from choice 0 once its prompt is in; aborting choice 0 mid-prefill ends
    them too, each with its own update (a stream waiting on them would hang otherwise)."""
    core.add_request(EngineRequest("r", list(range(3, 23)), greedy(5, n=3), 0.0))
    core.step()  # the first 8-token chunk of the 20-token prompt
    updates = core.abort_request("r", 0)
    assert sorted((u.index, u.finish_reason) for u in updates) == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert "r" not in core.requests
    run(core)
    assert core.kv.usage().used_blocks == 0


@pytest.mark.parametrize("prompt_len,params,match", [
    (0, greedy(3), "at least one token"),  # accepted, it failed the next step and every request in it
    (64, greedy(3), "max_model_len"),
    (60, greedy(6), "max_model_len"),  # 65 positions: the last token is never forwarded, 64 would fit
    (4, greedy(2, n=7), "max_num_seqs"),
])
def test_a_request_it_can_never_run_is_refused_alone(core, prompt_len, params, match):
    with pytest.raises(ValueError, match=match):
        core.add_request(EngineRequest("over", [5] * prompt_len, params, 0.0))
    core.add_request(EngineRequest("y", [5] * 10, greedy(10), 0.0))  # its neighbour runs as ever
    assert run(core) == {("y", 0): "length"}


def test_a_prompt_of_max_model_len_tokens_samples_one_token(core):
    """Scoring a full-context prompt (echo, max_tokens 0: one token sampled and dropped): the prompt takes
    every position, the sampled token none; its blocks come back."""
    core.add_request(EngineRequest("full", [5 + i % 90 for i in range(64)], greedy(1), 0.0))
    assert run(core) == {("full", 0): "length"}
    assert core.kv.usage().used_blocks == 0


def test_max_model_len_fits_the_cache():
    """A sequence of max_model_len tokens fits the KV cache: an asked max_model_len above it is refused at
    start-up (as vLLM's), the model's own is cut to it; a choice above it is refused alone."""
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        build_core(EngineConfig(**{**TINY, "num_blocks": 8}))  # 7 usable blocks of 4: 28 tokens, asked 64
    core, info = build_core(EngineConfig(**{**TINY, "num_blocks": 8, "max_model_len": None}))
    assert info.max_model_len == info.capacity_tokens == core.runner.max_model_len == 28
    # the block tables are as wide as the cache's 7 blocks, not the model's positions (a config's 2**40
    # asked for terabytes of tables: a review)
    assert core.runner.state.block_tables.shape[1] == 7 < core.runner.config.max_position_embeddings // 4
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request(EngineRequest("big", [5] * 20, greedy(10), 0.0))
    core.add_request(EngineRequest("y", [5] * 10, greedy(10), 0.0))
    assert run(core) == {("y", 0): "length"}


def test_prompts_sharing_a_running_prefix_are_admitted_together():
    """Four prompts share 25 blocks of a system prompt; each adds 1 block (+ 2 of output) of its own: all
    fit at once in 39 usable blocks, and admission counts the shared blocks as the hits they are."""
    core, _ = build_core(EngineConfig(**{**TINY, "block_size": 16, "num_blocks": 40, "max_num_seqs": 8,
                                         "max_num_batched_tokens": 2048, "max_model_len": 512}))
    system = [3 + (i * 37) % 250 for i in range(400)]
    for i in range(4):
        core.add_request(EngineRequest(f"r{i}", system + [10 + i] * 8, greedy(24), 0.0))
    peak = 0
    while core.has_work():
        core.step()
        peak = max(peak, len(core.scheduler.running))
    assert peak == 4
    assert core.kv.usage().used_blocks == 0


def test_a_token_in_flight_does_not_preempt_another_sequence(core):
    """Async scheduling: A's first token (its stop: every id is one) is still on its way when the cache has
    no block left for A's next decode; A waits a step instead of preempting B, whose prompt filled the
    cache, and B's work is not thrown away (sync scheduling never sees a token in flight)."""
    vocab = core.runner.config.vocab_size
    cfg = {**TINY, "num_blocks": 8, "max_num_seqs": 4, "max_num_batched_tokens": 48, "max_model_len": 28}
    small, _ = build_core(EngineConfig(**cfg, async_scheduling=core.async_scheduling))
    small.add_request(EngineRequest("A", [7, 8, 9, 10], greedy(10, stop_token_ids=list(range(vocab))), 0.0))
    small.add_request(EngineRequest("B", list(range(30, 52)), greedy(2), 0.0))  # 22 tokens: 6 of 7 blocks
    assert run(small) == {("A", 0): "stop", ("B", 0): "length"}
    assert small.scheduler.num_preemptions == 0
    assert small.kv.usage().used_blocks == 0


def test_a_kv_cache_that_cannot_be_allocated_names_its_flag():
    """--num-blocks 10**11: the allocator's own message named no flag (a review)."""
    with pytest.raises(ValueError, match=r"KV cache of 100000000000 blocks .* lower --num-blocks"):
        build_core(EngineConfig(**{**TINY, "num_blocks": 10**11, "max_model_len": None}))


def run_tokens(core, max_steps: int = 500) -> tuple[dict[tuple[str, int], list[int]], list[str]]:
    """-> every choice's tokens and the request ids in the order their first choice finished."""
    tokens, finished = {}, []
    for _ in range(max_steps):
        if not core.has_work():
            return tokens, finished
        for u in core.step().updates:
            tokens.setdefault((u.request_id, u.index), []).extend(u.new_token_ids)
            if u.finish_reason is not None and u.request_id not in finished:
                finished.append(u.request_id)
    raise AssertionError("no progress")


def test_a_small_request_is_not_held_behind_a_wide_one_that_does_not_fit(core):
    """max_num_seqs 6: while `long` holds a row, the n = 6 request cannot enter; the small one queued after
    it runs and finishes meanwhile, and the wide one's six choices are the tokens they are alone."""
    core.add_request(EngineRequest("long", list(range(3, 9)), greedy(30), 0.0))
    core.add_request(EngineRequest("wide", list(range(10, 15)), greedy(4, n=6), 0.0))
    core.add_request(EngineRequest("small", list(range(20, 24)), greedy(3), 0.0))
    tokens, finished = run_tokens(core)
    assert finished == ["small", "long", "wide"]
    assert core.kv.usage().used_blocks == 0
    solo, _ = build_core(EngineConfig(**TINY, async_scheduling=False))
    solo.add_request(EngineRequest("wide", list(range(10, 15)), greedy(4, n=6), 0.0))
    alone, _ = run_tokens(solo)
    assert {k: v for k, v in tokens.items() if k[0] == "wide"} == alone
