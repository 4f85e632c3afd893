"""tools/engine_step_bench.py's closed loop on CPU (tiny preset): every request runs to its output length, no
more than C are in flight, and its prompts hit no prefix cached by the decode runs before it."""

from __future__ import annotations

import time

from server.engine.engine import EngineConfig, build_core
from tools import engine_step_bench


def test_closed_loop_runs_every_request_with_fresh_prompts(monkeypatch):
    core, _ = build_core(EngineConfig(model="tiny", device="cpu", dtype="float32", max_num_seqs=8,
                                      max_num_batched_tokens=256))
    probe = engine_step_bench.Probe(core)
    engine_step_bench.run_batch(core, probe, batch=3, prompt_len=48, warmup=1, steps=2, mode="greedy")
    in_flight, added = [], []
    add = core.add_request

    def counting_add(request):
        added.append(request)
        add(request)
        in_flight.append(len(core.requests))

    monkeypatch.setattr(core, "add_request", counting_add)
    hits = core.kv.usage().prefix_hits
    t0 = time.perf_counter()
    r = engine_step_bench.closed_loop(core, concurrency=3, num_requests=7, prompt_len=48, output_len=5)
    assert time.perf_counter() - t0 < 120
    assert r["tokens"] == 7 * 5 and len(added) == 7 and max(in_flight) <= 3
    assert core.kv.usage().prefix_hits == hits  # the closed loop's prompts are not the decode runs'
    assert r["prefix_hit_rate"] == 0.0 and not r["cached"]
    assert not core.has_work() and r["tok_s"] > 0 and r["wall_s"] > 0


def test_the_cached_closed_loop_replays_its_prompts_from_the_prefix_cache():
    core, _ = build_core(EngineConfig(model="tiny", device="cpu", dtype="float32", max_num_seqs=8,
                                      max_num_batched_tokens=256))
    r = engine_step_bench.closed_loop(core, concurrency=3, num_requests=5, prompt_len=48, output_len=3,
                                      cached=True)
    # 48-token prompts are 3 blocks of 16: the replay finds the first two cached (the last token is computed)
    assert r["cached"] and r["tokens"] == 5 * 3
    assert r["prefix_hit_rate"] == 32 / 48
    assert not core.has_work()


def test_the_sampled_closed_loop_draws_with_the_sampled_parameters(monkeypatch):
    core, _ = build_core(EngineConfig(model="tiny", device="cpu", dtype="float32", max_num_seqs=8,
                                      max_num_batched_tokens=256))
    params = []
    add = core.add_request
    monkeypatch.setattr(core, "add_request", lambda request: (params.append(request.params), add(request)))
    engine_step_bench.closed_loop(core, concurrency=2, num_requests=3, prompt_len=48, output_len=4)
    params.clear()
    r = engine_step_bench.closed_loop(core, concurrency=2, num_requests=3, prompt_len=48, output_len=4,
                                      sampled=True)
    assert r["sampled"] and not r["cached"] and r["tokens"] == 3 * 4
    assert r["prefix_hit_rate"] == 0.0  # not the greedy run's prompts
    assert {(p.temperature, p.top_p) for p in params} == {(0.8, 0.95)} and not any(p.greedy for p in params)
    assert not core.has_work()
