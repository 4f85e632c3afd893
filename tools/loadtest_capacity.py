"""How many SSE events one load-generator process takes: `python -m tools.loadtest_capacity`.

Starts `loadtest.mock_server` in its own process with no token delay (it streams as fast as it can), drives
it from this process with `loadtest.benchmark.run_benchmark` (one asyncio loop, one httpx client) and reports
the events (content chunks) received per wall second and per CPU second of this process. Events per CPU
second is the figure that matters: it is what one process takes at 100% busy, whichever side is slower on
the machine at hand. A cProfile of one run (`--profile`) shows where the client's time goes.
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

import httpx

from loadtest.benchmark import drive as drive_benchmark
from loadtest.client import ClientConfig
from loadtest.mock_server import free_port
from loadtest.workload import LengthRange, build_workload


def start_mock(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "loadtest.mock_server", "--port", str(port),
           "--first-token-ms", "0", "--inter-token-ms", "0"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("mock server did not start")


def drive(url: str, num_requests: int, concurrency: int, output_len: int) -> dict:
    specs = build_workload(num_requests, LengthRange(16, 16), LengthRange(output_len, output_len), 0)
    cfg = ClientConfig(url, "mock", timeout_s=60.0)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    run = asyncio.run(drive_benchmark(specs, cfg, concurrency, [0.0] * len(specs)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    events = sum(len(r.chunk_times) for r in run.records)
    assert all(r.success for r in run.records), [r.error for r in run.records if not r.success][:3]
    assert events == num_requests * output_len, events
    return {"concurrency": concurrency, "events": events, "wall_s": wall, "cpu_s": cpu,
            "events_per_s": events / wall, "events_per_cpu_s": events / cpu, "busy": cpu / wall}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.loadtest_capacity")
    p.add_argument("--concurrency", default="16,64", help="comma-separated levels")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="runs per level; the best is reported")
    p.add_argument("--profile", action="store_true", help="print the cProfile top 25 of one run")
    p.add_argument("--out", default=None, metavar="JSON")
    args = p.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_mock(port)
    rows = []
    try:
        drive(url, 16, 16, 16)  # warm the connection pool path and the server
        for level in (int(x) for x in args.concurrency.split(",")):
            runs = [drive(url, args.num_requests, level, args.output_len) for _ in range(args.repeats)]
            rows.append(max(runs, key=lambda r: r["events_per_cpu_s"]))
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(drive, url, args.num_requests, rows[-1]["concurrency"], args.output_len)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        server.terminate()
        server.wait(timeout=10)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"{'concurrency':>11} {'events':>8} {'events/s':>10} {'events/cpu-s':>13} {'busy':>6}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['events']:>8} {r['events_per_s']:>10,.0f} "
              f"{r['events_per_cpu_s']:>13,.0f} {r['busy']:>6.0%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
