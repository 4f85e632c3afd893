"""loadtest --processes: the work split over worker processes, merged records, the generator's CPU fields."""

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from loadtest.benchmark import open_clients
from loadtest.cli import main
from loadtest.client import ClientConfig
from loadtest.cpu import ProcessLoad, busy_warning, load_fields
from loadtest.mock_server import MockScript, MockServer, serve_in_thread
from loadtest.processes import (
    WorkerError,
    auto_processes,
    concurrency_shares,
    run_workload,
    shared_claim,
    warm_clients,
)
from loadtest.report import print_report
from loadtest.sweep import sweep_warnings
from loadtest.workload import LengthRange, RequestSpec, arrival_offsets, build_workload

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[1]


def test_workers_share_the_concurrency_by_slot():
    # slots 0..4 -> workers 0,1,0,1,0
    assert concurrency_shares(7, 5, 2) == [3, 2]
    assert concurrency_shares(2, 8, 4) == [4, 4]  # no worker without a request to send
    assert concurrency_shares(5, 1, 4) == [1]  # no more workers than slots
    for n, c, p in ((100, 64, 3), (10, 7, 7), (1, 1, 1)):
        assert sum(concurrency_shares(n, c, p)) == c


def test_claims_from_one_counter_hand_out_every_index_once():
    counter = multiprocessing.get_context("spawn").Value("q", 0)
    a, b = shared_claim(counter, 5), shared_claim(counter, 5)
    assert [a(), b(), b(), a(), a(), b(), a()] == [0, 1, 2, 3, 4, None, None]


def test_a_free_slot_of_any_worker_takes_the_next_request():
    """Concurrency 2 over 2 workers, long requests at even indices and short ones at odd: with requests tied
    to a worker (j % 2), one worker sends the four long ones one after the other while the other idles; with
    shared claims both slots stay busy, as in one process (a review: -25% throughput with uneven lengths)."""
    specs = [RequestSpec(j, [5] * 4, 4, 40 if j % 2 == 0 else 2) for j in range(8)]
    cfg = ClientConfig("", "mock", timeout_s=10.0)
    with serve_in_thread(MockServer(MockScript(0.005, 0.005))) as url:
        cfg = replace(cfg, base_url=url)
        one = asyncio.run(run_workload(specs, cfg, 2, [0.0] * 8, 1))
        two = asyncio.run(run_workload(specs, cfg, 2, [0.0] * 8, 2))
    assert all(r.success for r in one.records + two.records)
    # tied: ~4 x 40 tokens in series (0.8 s); shared: ~(4 x 40 + 4 x 2) / 2 (0.42 s), as one process
    assert two.duration_s < 1.25 * one.duration_s, (two.duration_s, one.duration_s)


def test_auto_processes_rule():
    assert [auto_processes(c, cpus=16) for c in (1, 8, 9, 16, 33, 64, 256)] == [1, 1, 2, 2, 5, 8, 8]
    assert auto_processes(256, cpus=2) == 1 and auto_processes(256, cpus=1) == 1
    assert 1 <= auto_processes(256) <= max(1, (os.cpu_count() or 1) // 2)


def test_load_fields_and_warning():
    loads = [ProcessLoad("driver", 1.0, 2.0), ProcessLoad("driver", 1.8, 2.0),
             ProcessLoad("parent", 0.2, 2.0)]  # fmt: skip
    fields = load_fields(loads)
    assert fields == pytest.approx(
        # util over the three processes measured (over the two drivers alone the parent's CPU made it > 1
        # where they were busy); busy_max the drivers' (more --processes does not relieve the parent)
        {"client_processes": 2, "client_cpu_s": 3.0, "client_cpu_util": 0.5, "client_busy_max": 0.9}
    )
    busy_parent = [ProcessLoad(role, 1.9, 2.0) for role in ("driver", "driver", "parent")]
    assert load_fields(busy_parent)["client_cpu_util"] <= 1.0
    assert "--processes (now 2)" in busy_warning(fields)
    assert busy_warning(load_fields(loads[:1])) is None  # 50% busy
    assert load_fields([]) == {}


@pytest.fixture(scope="module")
def mock_url():
    with serve_in_thread(MockServer(MockScript(0.01, 0.004))) as url:
        yield url


def run_cli(url, out, *extra):
    argv = ["--base-url", url, "--input-len", "8", "--output-len", "10", "--no-progress", "--out", str(out),
            *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads(Path(out).read_text())


def test_two_processes_match_one(mock_url, tmp_path):
    common = ("--num-requests", "12", "--concurrency", "4", "--output-len-range", "5,15")
    one = run_cli(mock_url, tmp_path / "one.json", *common)
    two = run_cli(mock_url, tmp_path / "two.json", *common, "--processes", "2")
    for r in (one, two):
        assert (r["completed"], r["failed"]) == (12, 0)
        assert sorted(row["index"] for row in r["requests"]) == list(range(12))
    assert (
        two["total_output_tokens"]
        == one["total_output_tokens"]
        == sum(row["output_tokens"] for row in one["requests"])
    )
    assert sorted((x["index"], x["output_tokens"]) for x in two["requests"]) == sorted(
        (x["index"], x["output_tokens"]) for x in one["requests"]
    )
    # the metrics cover the merged records: one duration from the first send to the last completion (the
    # body's end, which the last token's event precedes: E2EL ends there, as vLLM's latency)
    starts = [row["start_s"] for row in two["requests"]]
    assert min(starts) == 0.0
    last_token = max(row["start_s"] + row["e2el_ms"] / 1000 for row in two["requests"])
    assert last_token <= two["duration_s"] <= last_token + 0.05
    throughput = two["total_output_tokens"] / two["duration_s"]
    assert two["output_throughput"] == pytest.approx(throughput, rel=1e-12)
    assert two["ttft_ms"]["count"] == 12 and two["itl_ms"]["count"] == two["total_output_tokens"] - 12
    # CPU: one driver in-process, two workers plus the parent
    assert [x["role"] for x in one["client"]["loads"]] == ["driver"]
    assert [x["role"] for x in two["client"]["loads"]] == ["driver", "driver", "parent"]
    assert (one["client_processes"], two["client_processes"]) == (1, 2)
    assert two["config"]["processes"] == 2
    for r in (one, two):
        assert 0 < r["client_cpu_s"] <= sum(x["wall_s"] for x in r["client"]["loads"]) * 1.05
        assert 0 < r["client_cpu_util"] <= 1.05 and 0 < r["client_busy_max"] <= 1.05
        assert all(x["wall_s"] <= r["duration_s"] + 0.5 for x in r["client"]["loads"])


def test_workers_keep_the_arrival_schedule(mock_url):
    n = 6
    specs = build_workload(n, LengthRange(4, 4), LengthRange(2, 2), 0)
    offsets = arrival_offsets(n, 20.0, 1.0, 0)
    run = asyncio.run(run_workload(specs, ClientConfig(mock_url, "mock", timeout_s=10.0), n, offsets, 3))
    assert len(run.loads) == 4 and sum(x.role == "driver" for x in run.loads) == 3
    sends = {r.index: r.send_time - run.start_time for r in run.records}
    assert [sends[i] for i in range(n)] == pytest.approx(offsets, abs=0.04)  # one clock across processes


def test_sweep_with_two_processes(mock_url, tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = ["--base-url", mock_url, "--input-len", "8", "--output-len", "6", "--no-progress",
            "--num-requests", "8", "--sweep-concurrency", "1,4", "--processes", "2", "--warmup", "2",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert [r["config"]["concurrency"] for r in sweep] == [1, 4]
    assert [r["client_processes"] for r in sweep] == [1, 2]  # never more workers than slots
    assert all(r["completed"] == 8 and r["total_output_tokens"] == 48 for r in sweep)
    assert "client busy max" in capsys.readouterr().out


def test_ctrl_c_stops_every_worker(tmp_path):
    server = MockServer(MockScript(0.05, 0.05))  # 20 tokens: ~1 s per request
    out = tmp_path / "partial.json"
    with serve_in_thread(server) as url:
        cmd = [sys.executable, "-m", "loadtest", "--base-url", url, "--input-len", "8", "--output-len", "20",
               "--num-requests", "6", "--concurrency", "2", "--processes", "2", "--no-progress",
               "--out", str(out)]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while server.requests_started < 4 and time.monotonic() < deadline:  # the first pair has finished
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the parent and every worker
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "INTERRUPTED" in stdout and "Traceback" not in stderr
    partial = json.loads(out.read_text())
    assert partial["interrupted"] is True and partial["num_requested"] == 6
    assert partial["completed"] == 2 and partial["total_output_tokens"] == 40
    assert partial["client_processes"] == 2


def test_a_worker_that_dies_fails_the_run(mock_url):
    specs = build_workload(4, LengthRange(4, 4), LengthRange(200, 200), 0)  # ~0.8 s per request
    cfg = ClientConfig(mock_url, "mock", timeout_s=10.0)

    async def go():
        task = asyncio.create_task(run_workload(specs, cfg, 4, [0.0] * 4, 2))
        while len(multiprocessing.active_children()) < 2:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
        return await task

    with pytest.raises(WorkerError, match="load generator worker . exited"):
        asyncio.run(go())
    assert multiprocessing.active_children() == []


def test_printed_report_warns_when_the_generator_is_busy(capsys):
    base = {"config": {}, "num_requested": 1, "client_processes": 1, "client_cpu_s": 1.9,
            "client_cpu_util": 0.95}  # fmt: skip
    print_report(base | {"client_busy_max": 0.95}, Console(width=160))
    out = capsys.readouterr().out
    assert "client_cpu_util" in out and "may be the bottleneck" in out
    print_report(base | {"client_busy_max": 0.5}, Console(width=160))
    assert "bottleneck" not in capsys.readouterr().out


def test_sweep_warns_per_level():
    levels = [{"config": {"concurrency": c}, "client_processes": 1, "client_busy_max": b}
              for c, b in ((16, 0.4), (256, 0.97))]  # fmt: skip
    (line,) = sweep_warnings(levels)
    assert line.startswith("concurrency 256: load generator: a process was 97% busy")
    levels[0]["server_prefix_cache_hit_rate"] = 0.75
    cached, busy = sweep_warnings(levels)
    assert cached.startswith("concurrency 16: the server found 75% of this run's prompt tokens")


def test_each_worker_warms_its_clients_before_it_is_ready():
    """A fresh process's first httpx request is ~15 ms slower than the next: the worker spends it on a
    GET /health per client before reporting ready, so no measured request pays it in its TTFT."""
    seen: list[str] = []
    mock = MockServer(MockScript())

    async def counting(scope, receive, send):
        if scope["type"] == "http":
            seen.append(scope["path"])
        await mock(scope, receive, send)

    async def warm(url: str) -> int:
        async with open_clients(40, 10.0) as clients:  # 40 slots: 3 clients (pools of at most 16)
            await warm_clients(clients, ClientConfig(base_url=url, model="mock"))
            return len(clients)

    with serve_in_thread(counting) as url:
        num_clients = asyncio.run(warm(url))
    assert num_clients == 3 and seen == ["/health"] * 3
