"""The engine core in its own process: same greedy tokens as in-process, stop strings abort in the core,
kv_snapshot over the wire, start-up errors reported, and a core killed mid-stream fails every request in
flight quickly, turns /health to 503 and makes the server exit non-zero."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import threading
import time

import httpx
import llguidance
import pytest
import torch
from engine_helpers import TINY, make_engine, run_all, wait_until
from server_helpers import GREEDY, Server

from kvcache.snapshot import per_block
from server.api.async_engine import AsyncEngine
from server.engine.core_client import CoreStartupError
from server.engine.engine import EngineConfig
from server.engine.sampling_params import SamplingParams
from tools.serving_bench import api_server_pids

pytestmark = pytest.mark.timeout(180)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine():
    e = make_engine(in_process=False, num_blocks=24, max_num_batched_tokens=64)
    yield e
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    logging.getLogger("pagewalk.engine").addHandler(handler)
    try:
        e.shutdown(timeout=5)
    finally:
        logging.getLogger("pagewalk.engine").removeHandler(handler)
    # the core ends on Shutdown, by itself: exit code 0, never "did not stop ...; terminating it"
    assert not e.client.process.is_alive() and e.client.process.exitcode == 0
    assert not warnings, [r.getMessage() for r in warnings]


def jobs(tok) -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"j{i}", tok.encode(f"job {i}: " + "abc" * (2 + 3 * i)), greedy(40 + 8 * i, n=1 + i % 2))
            for i in range(5)]


def test_greedy_tokens_equal_in_process_and_across_processes(engine):
    remote = run_all(engine, jobs(engine.tokenizer))
    local_engine = make_engine(in_process=True, num_blocks=24, max_num_batched_tokens=64)
    try:
        local = run_all(local_engine, jobs(local_engine.tokenizer))
    finally:
        local_engine.shutdown(timeout=5)
    assert engine.metrics.value("pagewalk_num_preemptions_total") > 0  # 23 usable blocks: the mix preempts
    for r, s in zip(remote, local, strict=True):
        assert r.error is None and r.choices.keys() == s.choices.keys()
        for i, c in r.choices.items():
            assert c.token_ids == s.choices[i].token_ids and c.text == s.choices[i].text
            assert c.finish_reason == "length"
    assert wait_until(lambda: engine.health()["kv_cache"]["used_blocks"] == 0)
    assert engine.health()["engine_core"] == "process" and engine.health()["waiting"] == 0
    assert engine.health()["api_servers"] == 1


def test_sampled_choices_with_logprobs_cross_the_wire_unchanged(engine):
    """Every SeqUpdate field msgpack carries (logprobs, top lists, seeded sampling, penalties, n > 1)."""
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, n=2, logprobs=3,
                            presence_penalty=0.5, ignore_eos=True)
    prompt = engine.tokenizer.encode("sample me")
    (remote,) = run_all(engine, [("s-remote", prompt, params)])
    local_engine = make_engine(in_process=True, num_blocks=24, max_num_batched_tokens=64)
    try:
        (local,) = run_all(local_engine, [("s-local", prompt, params)])
    finally:
        local_engine.shutdown(timeout=5)
    assert remote.error is None and sorted(remote.choices) == [0, 1]
    for i, c in remote.choices.items():
        ref = local.choices[i]
        assert c.token_ids == ref.token_ids and c.text == ref.text
        assert [(lp.token_id, lp.token, len(lp.top)) for lp in c.logprobs] == \
            [(lp.token_id, lp.token, len(lp.top)) for lp in ref.logprobs]
        assert all(len(lp.top) == 3 for lp in c.logprobs)
        ref_lps = [lp.logprob for lp in ref.logprobs]
        assert [lp.logprob for lp in c.logprobs] == pytest.approx(ref_lps, abs=1e-5)


def test_logit_bias_and_min_tokens_cross_the_wire(engine):
    """logit_bias's int keys and min_tokens reach the core process: EOS (2) forced, held back for 3 tokens."""
    z = engine.tokenizer.encode("z", add_bos=False)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, logit_bias={2: 50.0, z: 20.0}, min_tokens=3,
                            include_stop_str_in_output=True)
    (res,) = run_all(engine, [("biased", engine.tokenizer.encode("bias me"), params)])
    c = res.choices[0]
    assert res.error is None and c.token_ids == [z, z, z, 2] and c.finish_reason == "stop"


def test_a_structured_output_crosses_the_wire(engine):
    """The grammar reaches the core process, which masks the draws and ends the choice when it is whole."""
    grammar = llguidance.LLMatcher.grammar_from_regex("(red|green|blue)-[0-9]{2}")
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=11, n=2, grammar=grammar)
    (res,) = run_all(engine, [("guided", engine.tokenizer.encode("a colour"), params)])
    assert res.error is None and len(res.choices) == 2
    for c in res.choices.values():
        assert re.fullmatch("(red|green|blue)-[0-9]{2}", c.text) and c.finish_reason == "stop"


def test_prompt_logprobs_with_ranks_cross_the_wire(engine):
    prompt = engine.tokenizer.encode("rank me")
    (res,) = run_all(engine, [("plp", prompt, greedy(2, prompt_logprobs=2))])
    entries = next(d.prompt_logprobs for out in res.outputs for d in out.deltas if d.prompt_logprobs)
    assert len(entries) == len(prompt) and entries[0] is None
    for logprob, rank, top in entries[1:]:
        assert isinstance(rank, int) and rank >= 1 and len(top) == 2 and logprob <= 0.0


def test_stop_string_ends_the_choice_and_aborts_it_in_the_core(engine):
    prompt = engine.tokenizer.encode("stop here")
    (full,) = run_all(engine, [("full", prompt, greedy(60))])
    text = full.choices[0].text
    stop = text[20:23]
    assert stop and text.find(stop) == 20, "the greedy text should give a fresh stop string at 20"
    (cut,) = run_all(engine, [("cut", prompt, greedy(60, stop=[stop]))])
    c = cut.choices[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text[:20], "stop", stop)
    assert len(c.token_ids) < 60
    idle = lambda: engine.health()["kv_cache"]["used_blocks"] == 0 and engine.health()["running"] == 0
    assert wait_until(idle)


def test_extreme_seeds_and_top_k_cross_the_wire_and_a_failed_send_leaves_nothing(engine, monkeypatch):
    """The int64 ends of seed and the largest top_k cross the process wire (msgpack); a request whose send
    fails (here: the encoder refuses) raises to its caller and is not left counted as waiting."""
    prompt = engine.tokenizer.encode("edges")
    edge = [(f"edge{i}", prompt, SamplingParams(max_tokens=3, temperature=0.7, seed=seed, top_k=2**63 - 1))
            for i, seed in enumerate((-2**63, 2**63 - 1))]
    for r in run_all(engine, edge):
        assert r.error is None and len(r.choices[0].token_ids) == 3
    real_send = engine.client.send

    def refusing_send(msg):
        if getattr(msg, "request_id", None) == "refused":
            raise OverflowError("can't serialize")
        real_send(msg)

    monkeypatch.setattr(engine.client, "send", refusing_send)

    async def refused():
        with pytest.raises(OverflowError):
            async for _ in engine.generate("refused", prompt, greedy(3)):
                pass

    asyncio.run(refused())
    assert engine.health()["waiting"] == 0  # the refused request is not left registered
    (after,) = run_all(engine, [("after-refused", prompt, greedy(3))])  # the id is free, the engine serves
    assert after.error is None


def test_kv_snapshot_and_stats_come_from_the_core_process(engine):
    async def main():
        agen = engine.generate("snap", engine.tokenizer.encode("y" * 40), greedy(300))
        async for _ in agen:
            snap, stats = await engine.kv_snapshot(), await engine.core_stats()
            break
        await agen.aclose()
        return snap, stats

    snap, stats = asyncio.run(main())
    used = [b for b in per_block(snap) if b["state"] == "used"]
    assert used and all(o["request_id"] == "snap" for b in used for o in b["owners"])
    assert stats["running"] == 1 and stats["used_blocks"] == len(used)


def test_a_core_that_cannot_start_is_reported():
    with pytest.raises(CoreStartupError, match="engine core failed to start.*[Cc]uda|CUDA"):
        AsyncEngine(EngineConfig(**{**TINY, "device": "cuda"}))


def test_core_killed_mid_stream_fails_every_request_and_the_server_exits_non_zero(tmp_path):
    srv = Server(tmp_path, "--num-blocks", "256")
    try:
        body = {"prompt": "keep going", "max_tokens": 1500, **GREEDY}
        results: dict[str, object] = {}
        first_events = threading.Event()

        def stream() -> None:
            events = []
            with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True},
                              timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first_events.set()
            results["stream"] = (events, time.monotonic())

        def plain() -> None:
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
            results["plain"] = (r.status_code, r.json(), time.monotonic())

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert first_events.wait(30)
        assert wait_until(lambda: srv.health()["running"] == 2, timeout=10)
        assert api_server_pids(srv.log.read_text()) == []  # one API server: serving_bench times the server
        os.kill(srv.core_pid(), signal.SIGKILL)
        killed = time.monotonic()
        health = None
        while health is None:  # /health answers 503 while the server shuts down (or it is gone already)
            try:
                r = httpx.get(f"{srv.url}/health", timeout=1)
                if r.status_code == 503:
                    health = r.json()
            except httpx.TransportError:
                health = {"status": "gone"}
        for t in threads:
            t.join(30)
        events, stream_end = results["stream"]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_error" and "engine core died" in err["message"]
        status, answer, plain_end = results["plain"]
        assert status == 500 and "engine core died" in answer["error"]["message"]
        assert max(stream_end, plain_end) - killed < 2.0
        assert health["status"] in ("dead", "gone")
        assert srv.proc.wait(timeout=30) != 0
        assert "engine core process died" in srv.log.read_text()
    finally:
        srv.stop()


def test_core_exits_when_the_api_process_is_killed(tmp_path):
    srv = Server(tmp_path)
    core = srv.core_pid()
    srv.proc.kill()
    srv.proc.wait(timeout=10)

    def gone() -> bool:
        try:
            os.kill(core, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{core}/stat") as f:  # reparented and exited, waiting to be reaped
            return f.read().split()[2] == "Z"

    assert wait_until(gone, timeout=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_core_process_serves_the_same_greedy_tokens_as_in_process():
    """The spawned core owns CUDA (the API process never initialises it) and matches the thread core."""
    cfg = dict(model="tiny", device="cuda", dtype="bfloat16", num_blocks=256, max_num_seqs=16,
               max_num_batched_tokens=256, attention_backend="triton")
    results = {}
    cuda_before = torch.cuda.is_initialized()  # earlier GPU tests of this pytest process may have done it
    for in_process in (False, True):
        e = AsyncEngine(EngineConfig(**cfg), in_process=in_process)
        e.start()
        try:
            assert e.health()["device"].startswith("cuda") and e.health()["attention_backend"] == "triton"
            results[in_process] = run_all(e, jobs(e.tokenizer))
        finally:
            e.shutdown(timeout=10)
        if not in_process and not cuda_before:
            assert not torch.cuda.is_initialized(), "the API process initialised CUDA"
    for r, s in zip(results[False], results[True], strict=True):
        assert r.error is None and {i: c.token_ids for i, c in r.choices.items()} == \
            {i: c.token_ids for i, c in s.choices.items()}


def test_the_core_process_freezes_its_start_up_heap(capfd):
    # a full collection over the start-up heap stalls every stream (server/heap.py): the core freezes it once
    # built, before it serves
    e = make_engine(in_process=False, num_blocks=24)
    try:
        run_all(e, [("h0", [5, 6, 7], greedy(2))])
    finally:
        e.shutdown(timeout=5)
    err = capfd.readouterr().err
    frozen = [int(line.rsplit("(", 1)[1].split()[0]) for line in err.splitlines()
              if "engine core: start-up heap frozen" in line]
    assert len(frozen) == 1 and frozen[0] > 10_000, err
