"""CoreLoop with several clients (the API servers of --api-server-count): each gets the updates of its own
requests and its own running count; aborts and duplicate ids cannot reach another client's requests."""

from __future__ import annotations

import os
import time
from collections import defaultdict

from server.engine.core_loop import CoreLoop
from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest, StepUpdate
from server.engine.sampling_params import SamplingParams
from server.engine.wire import Abort, Gone, Hello, Query, Ready, Reply, Shutdown

CFG = EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=16, num_blocks=128, max_num_seqs=8,
                   max_num_batched_tokens=256, attention_backend="torch")


def request(rid: str, max_tokens: int = 6) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, [5, 6, 7, 8], params, time.monotonic())


def run_loop(script: list[list[tuple[bytes, object]]]):
    """Runs a CoreLoop whose receive() hands out one batch of `script` per call (then nothing while the
    core has work, then Shutdown); returns every (client, message) it sent."""
    core, info = build_core(CFG)
    sent: list[tuple[bytes, object]] = []
    batches = iter(script)

    def receive(timeout):
        batch = next(batches, None)
        if batch is not None:
            return batch
        return [] if core.has_work() else [(b"ctl", Shutdown())]

    CoreLoop(core, info, receive, lambda client, msg: sent.append((client, msg))).run()
    return sent


def updates_of(sent, client: bytes) -> dict[str, list]:
    out = defaultdict(list)
    for c, msg in sent:
        if c == client and isinstance(msg, StepUpdate):
            for u in msg.updates:
                out[u.request_id].append(u)
    return out


def test_each_client_gets_its_own_requests_only():
    sent = run_loop([[(b"a", Hello()), (b"b", Hello()), (b"ctl", Hello(updates=False))],
                     [(b"a", request("r1")), (b"b", request("r2", 4))]])
    assert sorted(c for c, m in sent if isinstance(m, Ready)) == [b"a", b"b", b"ctl"]
    a, b = updates_of(sent, b"a"), updates_of(sent, b"b")
    assert set(a) == {"r1"} and set(b) == {"r2"}
    assert sum(len(u.new_token_ids) for u in a["r1"]) == 6 and a["r1"][-1].finish_reason == "length"
    assert sum(len(u.new_token_ids) for u in b["r2"]) == 4 and b["r2"][-1].finish_reason == "length"
    assert not any(c == b"ctl" and isinstance(m, StepUpdate) for c, m in sent)  # a control client: none
    # while both ran, each was told one running request of its own (the core's stats say two)
    both = [(c, m) for c, m in sent if isinstance(m, StepUpdate) and m.stats.running == 2]
    assert both and all(m.client_running == 1 for _, m in both)


def test_aborts_and_duplicate_ids_cannot_touch_another_clients_request():
    sent = run_loop([[(b"a", Hello()), (b"b", Hello())],
                     [(b"a", request("r1", 12))],
                     [(b"b", Abort("r1")), (b"b", request("r1"))],
                     [(b"a", request("r3", 12))], [(b"a", Abort("r3"))]])
    a, b = updates_of(sent, b"a"), updates_of(sent, b"b")
    assert a["r1"][-1].finish_reason == "length" and sum(len(u.new_token_ids) for u in a["r1"]) == 12
    assert a["r3"][-1].finish_reason == "abort"  # its owner's abort does end it
    assert [u.finish_reason for u in b["r1"]] == ["error"] and "already in the engine" in b["r1"][0].error


def test_a_client_may_reuse_an_id_it_aborted_in_the_same_turn():
    """An abort and a new add under the same id in one turn: the add was refused as a duplicate, the id's
    owner forgotten only once the turn's updates went out (a review)."""
    sent = run_loop([[(b"a", Hello()), (b"b", Hello())], [(b"a", request("x", 50))],
                     [(b"a", Abort("x")), (b"a", request("x", 3)), (b"b", request("x"))]])
    a, b = updates_of(sent, b"a"), updates_of(sent, b"b")
    assert [u.finish_reason for u in a["x"] if u.finish_reason] == ["abort", "length"]
    after = a["x"][[u.finish_reason for u in a["x"]].index("abort") + 1:]
    assert sum(len(u.new_token_ids) for u in after) == 3  # the new request's own tokens
    assert [u.finish_reason for u in b["x"]] == ["error"]  # another client's: still refused


def test_queries_are_answered_to_the_asker():
    sent = run_loop([[(b"a", Hello()), (b"b", Hello())], [(b"b", Query(7, "stats"))]])
    replies = [(c, m) for c, m in sent if isinstance(m, Reply)]
    assert [(c, m.call_id) for c, m in replies] == [(b"b", 7)]


def test_a_client_that_attaches_late_reads_the_cores_all_time_totals():
    # b says Hello after a's request has prefilled: the totals in b's updates are still the core's since
    # start-up (an API server that attaches after another has served reports the same /debug totals)
    sent = run_loop([[(b"a", Hello())], [(b"a", request("r1", 8))], [], [(b"b", Hello())],
                     [(b"b", request("r2", 4))]])
    last = {c: m.stats for c, m in sent if isinstance(m, StepUpdate)}
    ran = sum(m.stats.num_prefill_tokens for c, m in sent if c == b"a" and isinstance(m, StepUpdate))
    assert ran == 2 * len(request("r").prompt_token_ids)  # each prompt ran once
    assert last[b"a"].prefill_tokens == last[b"b"].prefill_tokens == ran
    assert last[b"a"].generated_tokens == last[b"b"].generated_tokens == 8 + 4
    seen_by_b = sum(m.stats.num_prefill_tokens for c, m in sent if c == b"b" and isinstance(m, StepUpdate))
    assert seen_by_b < ran  # what b could have summed from its own updates: r1's prefill came before it


def test_a_client_that_attaches_to_an_idle_core_gets_its_stats_at_once():
    # the core publishes nothing while idle: a client saying Hello then is sent the core's stats with its
    # Ready, not left with empty ones until the next step (an API server attaching after another served)
    idle = [[] for _ in range(12)]  # r1's 8 tokens run out, then the core waits
    sent = run_loop([[(b"a", Hello())], [(b"a", request("r1", 8))], *idle, [(b"b", Hello())],
                     [(b"ctl", Hello(updates=False))]])
    to_b = [m for c, m in sent if c == b"b"]
    assert isinstance(to_b[0], Ready) and isinstance(to_b[1], StepUpdate) and not to_b[1].updates
    assert to_b[1].stats.prefill_tokens == len(request("r").prompt_token_ids)
    assert to_b[1].stats.generated_tokens == 8 and to_b[1].stats.running == 0
    assert not any(c == b"ctl" and isinstance(m, StepUpdate) for c, m in sent)


def test_one_turn_adds_one_prompt_logprobs_request_and_aborts_reach_those_behind_it(monkeypatch):
    """A prompt-logprobs request runs its prompt's forward as it is added, on the loop's thread: a burst of
    them held the loop for seconds, no step ran, and the drain's aborts went unanswered until it took the
    core for hung (a review). One such add a turn, a step between; the adds behind it wait in order, and an
    abort of one that waits ends its choices "abort" without its forward (also at Shutdown)."""
    from server.engine import core as core_module

    forwards: list[int] = []
    real = core_module.prompt_logprobs
    monkeypatch.setattr(core_module, "prompt_logprobs",
                        lambda model, ids, k: forwards.append(len(ids)) or real(model, ids, k))
    logprobs = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    burst = [(b"a", EngineRequest(f"p{i}", [5, 6, 7, 8 + i], logprobs, time.monotonic())) for i in range(6)]
    # p1 heads the backlog when its abort comes (a review: it was added, its forward run, then aborted);
    # p5's abort comes in the turn that puts it back in the backlog
    sent = run_loop([[(b"a", Hello())], [*burst[:4], (b"a", request("plain", 3))],
                     [(b"a", Abort("p1"))], [(b"a", Abort("p3"))], [*burst[4:], (b"a", Abort("p5"))]])
    a = updates_of(sent, b"a")
    steps = [m for c, m in sent if c == b"a" and isinstance(m, StepUpdate)]
    assert len(forwards) == 3  # p0, p2, p4: p1, p3 and p5 were aborted while they waited
    for rid in ("p1", "p3", "p5"):
        assert [u.finish_reason for u in a[rid]] == ["abort"]
    for rid in ("p0", "p2", "p4", "plain"):
        assert a[rid][-1].finish_reason == "length" and sum(len(u.new_token_ids) for u in a[rid]) == 3
    # p0's first token came in the turn that added it, before p2 was added: a step between the forwards
    first_step = next(i for i, m in enumerate(steps) for u in m.updates if u.request_id == "p0")
    assert not any(u.request_id == "p2" for m in steps[:first_step + 1] for u in m.updates)
    stopped = run_loop([[(b"a", Hello())], [*burst[:2], (b"ctl", Shutdown())]])
    assert [u.finish_reason for u in updates_of(stopped, b"a")["p1"]] == ["abort"]


def test_a_client_whose_process_ended_has_its_requests_aborted():
    """Gone (the receiver's word for a client whose process ended): its requests stop running at once and
    their updates go to nobody; the other client's request runs on."""
    core_stats = []
    sent = run_loop([[(b"a", Hello()), (b"b", Hello())],
                     [(b"a", request("r1", 40)), (b"a", request("r2", 40)), (b"b", request("r3", 8))],
                     [], [(b"a", Gone())], []])
    for c, m in sent:
        if c == b"b" and isinstance(m, StepUpdate):
            core_stats.append(m.stats.running)
    a, b = updates_of(sent, b"a"), updates_of(sent, b"b")
    assert not any(u.finish_reason for us in a.values() for u in us)  # nothing after it ended
    assert sum(len(u.new_token_ids) for u in a["r1"]) < 40
    assert set(b) == {"r3"} and b["r3"][-1].finish_reason == "length"
    assert sum(len(u.new_token_ids) for u in b["r3"]) == 8
    assert 1 in core_stats[core_stats.index(3):]  # r3 alone runs once a's end is seen


def test_the_client_watch_reports_an_ended_process_once(monkeypatch):
    import subprocess
    import sys

    from server.engine import core_process

    monkeypatch.setattr(core_process, "PARENT_CHECK_MS", 0)
    watch = core_process.ClientWatch()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch.add(b"a", child.pid)
    watch.add(b"b", os.getpid())
    watch.add(b"ctl", 0)  # in-process: nothing to watch
    assert watch.gone() == []
    child.kill()  # a zombie until reaped: ended already
    time.sleep(0.2)
    assert [(c, type(m)) for c, m in watch.gone()] == [(b"a", Gone)]
    child.wait()
    assert watch.gone() == []


def test_messages_after_a_clients_gone_are_dropped():
    """An add a client sent just before it ended, read after its Gone, ran for nobody and counted in the
    other client's running (a review): the core's receiver puts Gone after the messages it read, and the
    loop drops whatever comes later from a client it forgot."""
    sent = run_loop([[(b"a", Hello()), (b"b", Hello())], [(b"b", request("rb", 4))],
                     [(b"a", Gone()), (b"a", request("orphan", 30))]])
    assert "orphan" not in updates_of(sent, b"b")
    assert all(m.stats.running <= 1 for _, m in sent if isinstance(m, StepUpdate))


def test_a_gone_clients_updates_of_its_last_turn_reach_no_one():
    """Its abort, or an add that failed, in the turn of its Gone: with one client left the single-client
    shortcut handed them to that client (a review)."""
    bad = EngineRequest("bad", [10**9], SamplingParams(max_tokens=2), time.monotonic())  # out of the vocab
    sent = run_loop([[(b"a", Hello()), (b"b", Hello())], [(b"a", request("ra", 40))], [],
                     [(b"a", Abort("ra")), (b"a", bad), (b"a", Gone())], [(b"b", request("rb", 3))]])
    b = updates_of(sent, b"b")
    assert set(b) == {"rb"} and b["rb"][-1].finish_reason == "length"
