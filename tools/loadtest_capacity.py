"""How many SSE events the load generator takes: `python -m tools.loadtest_capacity`.

Starts `--server-processes` copies of `loadtest.mock_server` sharing one port (SO_REUSEPORT), streaming with
no token delay, and drives them through `loadtest.processes.run_workload` at each concurrency level and
load-generator process count. Per run it reports the events (content chunks) per wall second, the busiest
generator process (CPU / wall) and the events per driver CPU second: the last is what one generator
process takes at 100% busy, whichever side is slower on the machine at hand; one event per network read
(the server slower than the client) is the costly case a real server gives. `--profile` prints the
cProfile top 25 (wall clock, sorted by own time) of an in-process run at the last level.

On the GPU host, before a serving measurement (the server needs the other cores):
    python -m tools.loadtest_capacity --server-processes 6 --processes 1,2,4 --concurrency 64,256
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

from loadtest.client import ClientConfig
from loadtest.mock_server import free_port
from loadtest.processes import run_workload
from loadtest.workload import LengthRange, build_workload
from tools.server_wait import ServerNotHealthy, wait_healthy


def start_mocks(port: int, count: int) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "loadtest.mock_server", "--port", str(port), "--reuse-port",
           "--first-token-ms", "0", "--inter-token-ms", "0"]  # fmt: skip
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen(cmd, **quiet) for _ in range(count)]
    try:
        wait_healthy(f"http://127.0.0.1:{port}", lambda: all(p.poll() is None for p in procs), 30, poll_s=0.1)
    except ServerNotHealthy as e:
        stop_mocks(procs)
        raise RuntimeError(f"mock server did not start: {e}") from None
    time.sleep(1.0)  # the other copies bind too
    return procs


def stop_mocks(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=10)


def drive(url: str, num_requests: int, concurrency: int, output_len: int, processes: int) -> dict:
    specs = build_workload(num_requests, LengthRange(16, 16), LengthRange(output_len, output_len), 0)
    cfg = ClientConfig(url, "mock", timeout_s=60.0)
    run = asyncio.run(run_workload(specs, cfg, concurrency, [0.0] * len(specs), processes))
    assert all(r.success for r in run.records), [r.error for r in run.records if not r.success][:3]
    events = sum(len(r.chunk_times) for r in run.records)
    assert events == num_requests * output_len, events
    driver_cpu = sum(x.cpu_s for x in run.loads if x.role == "driver")
    return {"concurrency": concurrency, "processes": sum(x.role == "driver" for x in run.loads),
            "events": events, "duration_s": run.duration_s, "events_per_s": events / run.duration_s,
            "busy_max": max(x.busy for x in run.loads), "events_per_driver_cpu_s": events / driver_cpu,
            "loads": [vars(x) for x in run.loads]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.loadtest_capacity")
    p.add_argument("--concurrency", default="16,64,256", help="comma-separated levels")
    p.add_argument("--processes", default="1", help="comma-separated load-generator process counts")
    p.add_argument("--server-processes", type=int, default=1, help="mock servers sharing the port")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="runs per cell; the best events/CPU-s is kept")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None, metavar="JSON")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.processes.split(",")]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    mocks = start_mocks(port, args.server_processes)
    rows = []
    try:
        drive(url, 16, 16, 16, 1)  # warm the server and the client path
        for n in counts:
            for level in levels:
                runs = [drive(url, args.num_requests, level, args.output_len, n) for _ in range(args.repeats)]
                rows.append(max(runs, key=lambda r: r["events_per_driver_cpu_s"]))
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(drive, url, args.num_requests, levels[-1], args.output_len, 1)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        stop_mocks(mocks)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"mock servers: {args.server_processes}; {args.num_requests} requests x {args.output_len} tokens")
    header = ("processes", 9), ("concurrency", 11), ("events/s", 10), ("busy max", 8), ("events/cpu-s", 19)
    print(" ".join(f"{name:>{width}}" for name, width in header))
    for r in rows:
        print(f"{r['processes']:>9} {r['concurrency']:>11} {r['events_per_s']:>10,.0f} {r['busy_max']:>8.0%} "
              f"{r['events_per_driver_cpu_s']:>19,.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
