"""`pagewalk serve --api-server-count 2`: two API server processes share the port and one engine core.

Requests through either complete and free their blocks, /metrics sums both servers, SIGTERM drains every
stream, and a dead core or a dead API server ends the whole server with a non-zero exit."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import EXIT_AFTER_KILL_S, GREEDY, REPO, Server, free_port, wait_timed

from server.api.metrics import MULTIPROC_DIR_ENV
from tests.engine_helpers import wait_until
from tools.serving_bench import api_server_pids


def two_servers(tmp_path, *args: str) -> Server:
    return Server(tmp_path, "--api-server-count", "2", "--num-blocks", "256", *args)


def server_pids(srv: Server) -> list[int]:
    match = re.search(r"2 API servers \(pids (\d+), (\d+)\)", srv.log.read_text())
    assert match, srv.log.read_text()
    return [int(match.group(1)), int(match.group(2))]


def stream_tokens(srv: Server, max_tokens: int, started: threading.Event | None = None) -> list[str]:
    body = {"prompt": "count on", "max_tokens": max_tokens, "stream": True, **GREEDY}
    events = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if started is not None:
                    started.set()
    return events


def finish_reason(events: list[str]) -> str | None:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return next((c["choices"][0]["finish_reason"] for c in reversed(chunks) if c.get("choices")), None)


def test_two_api_servers_serve_every_request_sum_their_metrics_and_drain_on_sigterm(tmp_path):
    srv = two_servers(tmp_path)
    try:
        assert "api_server=1/2" in srv.log.read_text() or "api_server=2/2" in srv.log.read_text()
        pids = server_pids(srv)
        assert api_server_pids(srv.log.read_text()) == pids  # how tools/serving_bench finds them
        assert srv.health()["api_servers"] == 2
        # both servers attached to the core (each logs its line after its handshake): the histogram is
        # observed by server 1 from then on (the step counters count the core's whole history)
        assert wait_until(lambda: all(f"api_server={i}/2" in srv.log.read_text() for i in (1, 2)), 30)
        ran_before = srv.metric("pagewalk_iteration_tokens_total_sum")
        body = {"prompt": "hello there", "max_tokens": 8, **GREEDY}

        def one(_) -> dict:
            return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(32)))
        texts = {a["choices"][0]["text"] for a in answers}
        assert len(texts) == 1 and all(a["usage"]["completion_tokens"] == 8 for a in answers)  # greedy
        srv.wait_idle()  # the core's view, from either server: nothing running, every block free
        assert srv.metric("pagewalk_request_success_total", {"finished_reason": "length"}) == 32
        assert srv.metric("pagewalk_generation_tokens_total") == 32 * 8
        # the core's steps are counted once, by the server that records the core's metrics: every prompt token
        # (no prefix hit: the prompt is under a block) and 7 decode tokens a request (CPU: no async overlap)
        ran = srv.metric("pagewalk_prompt_tokens_total") + 32 * 7
        assert wait_until(lambda: srv.metric("pagewalk_iteration_tokens_total_sum") - ran_before == ran), (
            srv.metric("pagewalk_iteration_tokens_total_sum"), ran_before, ran)
        assert srv.metric("pagewalk_iteration_tokens_total_count") <= sum(
            srv.metric("pagewalk_engine_steps_total", {"kind": kind}) for kind in ("prompt", "decode"))
        # the block map's totals are the core's, whichever server answers
        totals = [httpx.get(f"{srv.url}/debug/kvcache", timeout=30).json()["totals"] for _ in range(6)]
        assert all(t["generated_tokens"] == 32 * 8 and t == totals[0] for t in totals), totals
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
        # SIGTERM with streams in flight: every server drains its own, then the core stops
        started = [threading.Event() for _ in range(6)]
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stream_tokens, srv, 150, ev) for ev in started]
            assert all(ev.wait(60) for ev in started)
            srv.proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=90) for f in futures]
        assert all(r[-1] == "[DONE]" and finish_reason(r) == "length" for r in results)
        assert srv.proc.wait(timeout=60) == 0, srv.log.read_text()[-4000:]
    finally:
        srv.stop()


def test_a_dead_core_ends_every_stream_and_the_server(tmp_path):
    srv = two_servers(tmp_path)
    try:
        started = [threading.Event() for _ in range(4)]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream_tokens, srv, 2000, ev) for ev in started]
            assert all(ev.wait(60) for ev in started)
            os.kill(srv.core_pid(), signal.SIGKILL)
            killed = time.monotonic()
            results = [f.result(timeout=30) for f in futures]
            ended = time.monotonic()
        for events in results:
            assert events[-1] == "[DONE]"
            assert "engine core died" in json.loads(events[-2])["error"]["message"]
        assert ended - killed < 3.0
        assert srv.proc.wait(timeout=30) != 0
    finally:
        srv.stop()


def test_a_dead_api_server_stops_the_server(tmp_path):
    srv = two_servers(tmp_path)
    try:
        core = srv.core_pid()
        os.kill(server_pids(srv)[0], signal.SIGKILL)
        assert srv.proc.wait(timeout=60) != 0
        assert "exited with code -9" in srv.log.read_text()
        time.sleep(0.5)
        assert not os.path.exists(f"/proc/{core}") or open(f"/proc/{core}/stat").read().split()[2] == "Z"
    finally:
        srv.stop()


def test_a_refusal_names_the_servers_share_of_the_waiting_bound(tmp_path):
    # two servers share --max-waiting 3 as 2 and 1 (the parts sum to the setting): a request of more prompts
    # than the smaller part is a 400 from either server (which one answers is the kernel's pick), and the
    # 400 says so rather than naming the part as the setting
    srv = two_servers(tmp_path, "--max-waiting", "3")
    try:
        for _ in range(4):
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert "the smallest API server's share, 1 of max_waiting=3" in message, r.text
    finally:
        srv.stop()


def test_a_server_that_exits_unasked_stops_the_server(tmp_path):
    # a SIGTERM sent to one API server alone: it drains and exits 0, but its share of --max-waiting (and,
    # for server 0, the core's metrics) would go unserved, so the supervisor stops everything, non-zero
    srv = two_servers(tmp_path)
    try:
        os.kill(server_pids(srv)[0], signal.SIGTERM)
        assert srv.proc.wait(timeout=60) != 0
        # 0 once the server's handlers are set (it drained); -15 if the signal came while it was starting
        log = srv.log.read_text()
        assert re.search(r"exited with code (0|-15) unasked", log), log[-3000:]
    finally:
        srv.stop()


def test_a_hung_core_is_killed_within_the_shutdown_timeout(tmp_path):
    """README: a hung (stopped) core is killed, its streams fail and the exit is 1 within --shutdown-timeout
    + 8 s; with several API servers the one that finds it hung kills it through its pidfd. The kill is held
    to that bound (1 s of drain and ABORT_WAIT_S, 5: ~6 s), the exit to EXIT_AFTER_KILL_S after it: the
    processes' interpreters wind down slowly on a loaded box (8.8 s to the exit beside 3 busy processes)."""
    srv = two_servers(tmp_path, "--shutdown-timeout", "1")
    core = srv.core_pid()
    try:
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(stream_tokens, srv, 2000, started)
            assert started.wait(60)
            os.kill(core, signal.SIGSTOP)
            stopped = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            code, killed, exited = wait_timed(srv.proc, core, stopped)
            assert code == 1, srv.log.read_text()[-3000:]
            events = future.result(timeout=30)
        assert "engine core is hung" in json.loads(events[-2])["error"]["message"]
        assert killed < 1 + 8, (killed, exited)
        assert exited - killed < EXIT_AFTER_KILL_S, (killed, exited)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
        srv.stop()


def _count_in_two_processes_and_expose(out: str) -> None:
    """In a fresh interpreter (prometheus_client in multiprocess mode): two forked processes count, then
    this one writes the /metrics text of all three."""
    from server.api.metrics import EngineMetrics

    for n in (3, 4):
        pid = os.fork()
        if pid == 0:
            m = EngineMetrics("m", "torch", "cpu", "float32")
            m.generation_tokens.inc(n)
            m.inter_token_latency.observe(0.002)
            m.num_requests_running.set(n)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
    with open(out, "wb") as f:
        f.write(EngineMetrics("m", "torch", "cpu", "float32").exposition())


def test_metrics_of_several_processes_are_summed(tmp_path, monkeypatch):
    # inherited by the spawned interpreter before its prometheus_client import, as the supervisor sets it
    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    p = multiprocessing.get_context("spawn").Process(target=_count_in_two_processes_and_expose,
                                                     args=(str(tmp_path / "out.txt"),))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families((tmp_path / "out.txt").read_text())
               for s in f.samples}
    label = (("model_name", "m"),)
    assert samples[("pagewalk_generation_tokens_total", label)] == 7
    assert samples[("pagewalk_inter_token_latency_seconds_count", label)] == 2
    assert samples[("pagewalk_num_requests_running", label)] == 4  # a gauge: the most recent value
    assert samples[("pagewalk_info", (("attention_backend", "torch"), ("device", "cpu"), ("dtype", "float32"),
                                      ("model_name", "m")))] == 1


def test_sigterm_while_the_api_servers_start_is_a_clean_stop(tmp_path):
    """The supervisor's SIGTERM reaches servers still loading (before they set their handlers): they die of
    it, which is the stop it asked for: exit 0, no error."""
    port = free_port()
    log = tmp_path / "early.log"
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--device", "cpu",
           "--attention-backend", "torch", "--api-server-count", "2", "--num-blocks", "256"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "2 API servers (pids" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert "ERROR" not in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def _ignore_sigterm_and_sleep(ready) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(60)


def test_a_server_that_does_not_stop_is_killed_after_the_drain():
    """A hung API server (stopped, deadlocked) held the supervisor, and the core with it, for ever after
    SIGTERM (a review): past --shutdown-timeout + DRAIN_MARGIN_S it is killed and the exit is a failure."""
    from server.supervisor import _stopper, _wait

    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    hung = ctx.Process(target=_ignore_sigterm_and_sleep, args=(ready,))
    hung.start()
    assert ready.wait(60)  # its handler is set
    stopping = threading.Event()
    stop = _stopper([hung], stopping)
    stop()
    start = time.monotonic()
    assert _wait([hung], threading.Event(), stopping, stop, drain_s=0.5) is True
    assert time.monotonic() - start < 5 and hung.exitcode == -signal.SIGKILL


def test_a_core_whose_parent_ends_while_it_builds_exits_at_once(tmp_path):
    """Building the core looks at nothing else for minutes with a large checkpoint: a thread ends the
    orphan instead of letting it finish loading a model nobody will use (a review: 8.5 s on, built)."""
    script = ("import time\nfrom server.engine import core_process\ncore_process.PARENT_CHECK_MS = 50\n"
              "core_process._watch_parent_while_building(1)\ntime.sleep(30)\n")  # pid 1 is not its parent
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 1 and "the process that started it is gone" in done.stderr
    assert time.monotonic() - start < 20
