"""End-to-end engine tests on the real tiny model (CPU, torch attention): batching, fork, seeds, stops."""

from __future__ import annotations

import pytest
from engine_helpers import make_engine, run_all, run_one, wait_until

from server.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    e = make_engine()
    yield e
    e.shutdown(timeout=5)


def prompt_of(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_concurrent_greedy_requests_equal_their_solo_runs(engine):
    texts = ("Hello there", "The quick brown fox jumps over", "a" * 40, "Zy")
    prompts = [prompt_of(engine, t) for t in texts]
    solo = [run_one(engine, f"solo-{i}", p, greedy(20)) for i, p in enumerate(prompts)]
    together = run_all(engine, [(f"conc-{i}", p, greedy(20)) for i, p in enumerate(prompts)])
    for s, t in zip(solo, together, strict=True):
        assert len(s.choices[0].token_ids) == 20 and s.choices[0].finish_reason == "length"
        assert t.choices[0].token_ids == s.choices[0].token_ids
        assert t.choices[0].text == s.choices[0].text
    assert wait_until(lambda: engine.health()["kv_cache"]["used_blocks"] == 0)


def test_text_is_the_detokenized_token_ids(engine):
    res = run_one(engine, "detok", prompt_of(engine, "abc"), greedy(16))
    c = res.choices[0]
    assert c.text == engine.tokenizer.decode(c.token_ids)
    assert res.outputs[0].prompt_token_ids == prompt_of(engine, "abc")


def test_n2_forks_one_prefill_and_greedy_choices_match(engine):
    prompt = prompt_of(engine, "fork me please, a unique prompt #1")
    before = engine.num_prefill_tokens
    res = run_one(engine, "fork", prompt, greedy(12, n=2))
    assert engine.num_prefill_tokens - before == len(prompt)  # the prompt ran once, not twice
    assert sorted(res.choices) == [0, 1]
    assert res.choices[0].token_ids == res.choices[1].token_ids
    assert len(res.choices[0].token_ids) == 12
    assert res.outputs[-1].finished and all(c.finish_reason == "length" for c in res.choices.values())


def test_n3_sampled_choices_differ_and_all_finish(engine):
    params = SamplingParams(max_tokens=16, n=3, seed=1, ignore_eos=True)
    res = run_one(engine, "fork3", prompt_of(engine, "sampling many"), params)
    toks = [res.choices[i].token_ids for i in range(3)]
    assert all(len(t) == 16 for t in toks)
    assert len({tuple(t) for t in toks}) == 3


def test_seeded_sampling_is_reproducible_whatever_the_neighbours(engine):
    prompt = prompt_of(engine, "seeded")
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = run_one(engine, "seed-alone", prompt, params).choices[0].token_ids
    others = [(f"noise-{i}", prompt_of(engine, "x" * (i + 3)),
               SamplingParams(max_tokens=10 + i, ignore_eos=True)) for i in range(4)]
    crowd = run_all(engine, [others[0], others[1], ("seed-crowd", prompt, params), others[2], others[3]])
    assert crowd[2].choices[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    assert run_one(engine, "seed-other", prompt, other_seed).choices[0].token_ids != alone


def test_stop_string_is_withheld_and_ends_the_choice(engine):
    prompt = prompt_of(engine, "stop strings")
    full = run_one(engine, "stop-full", prompt, greedy(40)).choices[0].text
    assert len(full) >= 12
    stop = full[8:11]
    res = run_one(engine, "stop", prompt, greedy(40, stop=[stop]))
    c = res.choices[0]
    cut = full.index(stop)
    assert c.text == full[:cut] and stop not in c.text
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert all(stop not in d.text for o in res.outputs for d in o.deltas)


def test_stop_token_id_ends_the_choice(engine):
    prompt = prompt_of(engine, "stop token")
    full = run_one(engine, "stoptok-full", prompt, greedy(20)).choices[0].token_ids
    target = full[5]
    res = run_one(engine, "stoptok", prompt, greedy(20, stop_token_ids=[target]))
    c = res.choices[0]
    assert c.token_ids == full[:full.index(target) + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", target)


def test_eos_among_the_stop_token_ids_ends_as_eos_unless_eos_is_ignored(engine):
    """vLLM checks EOS first: a stop_token_ids list holding EOS leaves stop_reason null, unless ignore_eos
    makes EOS an ordinary token, when the list's id ends the choice."""
    eos = min(engine.tokenizer.eos_token_ids)
    prompt = prompt_of(engine, "eos listed")
    for ignore_eos, stop_reason in ((False, None), (True, eos)):
        params = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[eos], logit_bias={eos: 100.0},
                                ignore_eos=ignore_eos)
        c = run_one(engine, f"eos-listed-{ignore_eos}", prompt, params).choices[0]
        assert c.token_ids == [eos]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop_reason)


def test_a_long_stop_token_id_list_is_kept_distinct_and_matched_as_a_set(engine):
    """Repeats collapse (in order) where the params are made, so the wire carries each id once, and the
    core checks a token against a set: the same ending as the short list, whatever the list's length."""
    prompt = prompt_of(engine, "stop token")
    full = run_one(engine, "stoptok-ref", prompt, greedy(20)).choices[0].token_ids
    target = full[5]
    unused = [t for t in range(engine.vocab_size) if t not in full][:5000]
    params = greedy(20, stop_token_ids=unused * 20 + [target] * 3)
    assert params.stop_token_ids == unused + [target] and target in params.stop_token_set
    c = run_one(engine, "stoptok-long", prompt, params).choices[0]
    assert c.token_ids == full[:full.index(target) + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", target)


def test_logprobs_top_k_and_sampled(engine):
    res = run_one(engine, "lp", prompt_of(engine, "logprobs"), greedy(5, logprobs=3))
    c = res.choices[0]
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == tok and lp.top[0][2] == pytest.approx(lp.logprob)  # greedy = the best
        assert lp.top[0][2] >= lp.top[1][2] >= lp.top[2][2]
    plain = run_one(engine, "nolp", prompt_of(engine, "logprobs"), greedy(5))
    assert plain.choices[0].logprobs == [] and plain.choices[0].token_ids == c.token_ids


def test_penalties_change_greedy_output(engine):
    prompt = prompt_of(engine, "aaaa")
    base = run_one(engine, "pen-base", prompt, greedy(30)).choices[0].token_ids
    pen = run_one(engine, "pen", prompt, greedy(30, frequency_penalty=2.0)).choices[0].token_ids
    assert pen != base
    # a strong frequency penalty spreads the tokens out
    assert max(pen.count(t) for t in set(pen)) <= max(base.count(t) for t in set(base))


def test_health_and_metrics_after_requests(engine):
    run_one(engine, "metrics", prompt_of(engine, "metrics"), greedy(4))  # its own, whatever ran before
    h = engine.health()
    assert h["status"] == "ok" and h["model"] == "tiny" and h["device"] == "cpu"
    assert h["dtype"] == "float32" and h["attention_backend"] == "torch" and h["cuda_graphs"] is False
    assert h["decoder_ops"] == "torch" and h["kernels_refused"] == []
    assert h["kv_cache"]["num_blocks"] == 256 and h["kv_cache"]["block_size"] == 16
    kv = h["kv_cache"]
    assert kv["free_blocks"] + kv["used_blocks"] == kv["num_blocks"] - 1
    m = engine.metrics
    assert m.value("pagewalk_prompt_tokens_total") > 0
    assert m.value("pagewalk_generation_tokens_total") > 0
    assert m.value("pagewalk_time_to_first_token_seconds_count") > 0
    assert m.value("pagewalk_inter_token_latency_seconds_count") > 0
    assert m.value("pagewalk_e2e_request_latency_seconds_count") > 0
    assert m.value("pagewalk_request_success_total", {"finished_reason": "length"}) > 0
    assert m.value("pagewalk_info", {"model_name": "tiny", "attention_backend": "torch", "device": "cpu",
                                     "dtype": "float32"}) == 1.0
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert m.value(f"pagewalk_request_{name}_seconds_count") > 0
    # the handoff (arrival to the core taking the request in) is a part of the queue time, per request
    handoff, queue = "pagewalk_request_handoff_seconds", "pagewalk_request_queue_time_seconds"
    assert m.value(f"{handoff}_count") == m.value(f"{queue}_count")
    assert 0 < m.value(f"{handoff}_sum") <= m.value(f"{queue}_sum")
    assert m.value("pagewalk_request_prompt_tokens_sum") > 0
    assert m.value("pagewalk_request_generation_tokens_sum") > 0


def test_prefix_cache_skips_the_shared_prefix_and_output_is_unchanged(engine):
    prompt = prompt_of(engine, "a long shared system prompt that spans several blocks of sixteen tokens")
    first_before = engine.num_prefill_tokens
    first = run_one(engine, "prefix-1", prompt, greedy(8)).choices[0].token_ids
    assert engine.num_prefill_tokens - first_before == len(prompt)
    before = engine.num_prefill_tokens
    second = run_one(engine, "prefix-2", prompt, greedy(8)).choices[0].token_ids
    computed = engine.num_prefill_tokens - before
    assert computed == len(prompt) - (len(prompt) - 1) // 16 * 16  # only the last, partial block reruns
    assert second == first
    hits, queries = (engine.metrics.value(f"pagewalk_prefix_cache_{c}_total") for c in ("hits", "queries"))
    assert 0 < hits < queries


@pytest.mark.parametrize("in_process", [True, False])
def test_a_failing_metrics_update_holds_back_no_token(monkeypatch, in_process):
    # the step handler records the core's metrics after it hands the tokens on, and a handler's exception
    # is logged by the client (a core thread or the receiver thread) without stopping it
    e = make_engine(in_process=in_process)
    try:
        def broken(*_):
            raise ValueError("a metric refused its update")

        monkeypatch.setattr(e, "_record_core_metrics", broken)
        prompt = prompt_of(e, "metrics may fail")
        first = run_one(e, "m1", prompt, greedy(6))
        second = run_one(e, "m2", prompt, greedy(6))  # the core still serves
        assert first.error is None and len(first.choices[0].token_ids) == 6
        assert second.choices[0].token_ids == first.choices[0].token_ids
    finally:
        e.shutdown(timeout=5)
