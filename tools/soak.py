"""Soak: a bounded mixed workload with hang-ups against a CPU `pagewalk serve` (tiny preset).

    python -m tools.soak [--duration 300] [--concurrency 8] [--out DIR] [--url URL]

Without --url it starts the server itself (the engine core in its own process) and stops it with SIGTERM at
the end. Workers loop over: completions and chat, plain and streamed, several prompts with n > 1, stop
strings, logprobs, a refused (400) request, and hang-ups (a stream dropped after its first events, a plain
request dropped before its answer). At the end the server must be idle (no KV block used) and exit 0. Prints
requests served, errors by kind, p50/p99 latency and the server's RSS at start and end; --out gets
soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from tools.server_load import child_pids
from tools.server_wait import ServerNotHealthy, wait_healthy

REPO = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": 0, "ignore_eos": True}


def workload(rng: random.Random) -> tuple[str, str, dict]:
    """(kind, path, body) of one request."""
    kind = rng.choice(["plain", "stream", "chat", "chat_stream", "multi", "stops", "logprobs", "refused",
                       "hangup_stream", "hangup_plain", "biased", "guided"])
    max_tokens = rng.randint(4, 48)
    if kind in ("chat", "chat_stream"):
        messages = [{"role": "user", "content": f"say {rng.random()}"}]
        return kind, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                              "stream": kind == "chat_stream"}
    body = {"prompt": f"soak {rng.randint(0, 50)}", "max_tokens": max_tokens, **GREEDY}
    if kind == "multi":
        body.update(prompt=[f"p{i}" for i in range(rng.randint(2, 6))], n=rng.randint(1, 3), temperature=0.8)
    elif kind == "stops":
        body.update(stop=[f"{rng.choice('abcxyz')}{i}" for i in range(64)], stream=True)
    elif kind == "logprobs":
        body.update(logprobs=5, echo=True)
    elif kind == "refused":
        body.update(stop=["x"] * 65)  # over max_stop_strings
    elif kind == "hangup_stream":
        body.update(stream=True, max_tokens=400)
    elif kind == "hangup_plain":
        body.update(max_tokens=400)
    elif kind == "stream":
        body.update(stream=True)
    elif kind == "biased":  # the sampler's bias table: rows with and without entries, reused, preempted
        printable = range(3 + 32, 3 + 127)  # the presets' byte ids of printable ASCII
        bias = {str(rng.choice(printable)): rng.uniform(-100, 100) for _ in range(rng.randint(0, 8))}
        body.update(logit_bias=bias, min_tokens=rng.randint(0, max_tokens), ignore_eos=False,
                    n=rng.randint(1, 3), temperature=rng.choice([0, 0.8]), stream=rng.random() < 0.5,
                    stop=["e"], include_stop_str_in_output=rng.random() < 0.5)
        if rng.random() < 0.5:
            body["allowed_token_ids"] = rng.sample(printable, rng.randint(1, 12)) + [2]  # EOS among them
    elif kind == "guided":  # structured outputs: grammars compiling, token masks, the grammar ending a choice
        body.update(n=rng.randint(1, 2), temperature=rng.choice([0, 0.8]), stream=rng.random() < 0.5,
                    structured_outputs=rng.choice([
                        {"regex": f"[a-{rng.choice('cfz')}]{{1,{rng.randint(2, 40)}}}"},
                        {"choice": [f"option {i}" for i in range(rng.randint(1, 5))]},
                        {"json": {"type": "object", "properties": {"k": {"type": "integer"}},
                                  "required": ["k"]}}]))
    return kind, "/v1/completions", body


async def one(client: httpx.AsyncClient, rng: random.Random, stats: dict) -> None:
    kind, path, body = workload(rng)
    start = time.perf_counter()
    try:
        if kind == "hangup_plain":
            try:
                await client.post(path, json=body, timeout=rng.uniform(0.05, 0.3))
            except httpx.TimeoutException:
                pass
            stats["hangups"] += 1
            return
        if body.get("stream"):
            async with client.stream("POST", path, json=body, timeout=60) as r:
                if r.status_code != 200:
                    stats["errors"][f"{kind}:{r.status_code}"] += 1
                    return
                events = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        stats["errors"][f"{kind}:in-stream"] += 1
                    events += line.startswith("data: ")
                    if kind == "hangup_stream" and events >= 3:
                        stats["hangups"] += 1
                        return  # leaving the block closes the connection mid-stream
        else:
            r = await client.post(path, json=body, timeout=60)
            expected = 400 if kind == "refused" else 200
            if r.status_code != expected:
                stats["errors"][f"{kind}:{r.status_code}"] += 1
                return
        stats["served"] += 1
        stats["latencies"].append(time.perf_counter() - start)
    except httpx.HTTPError as e:
        stats["errors"][f"{kind}:{type(e).__name__}"] += 1


async def drive(url: str, duration: float, concurrency: int, seed: int) -> dict:
    stats = {"served": 0, "hangups": 0, "errors": Counter(), "latencies": []}
    deadline = time.monotonic() + duration

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url) as client:
            while time.monotonic() < deadline:
                await one(client, rng, stats)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return stats


def rss_mb(pid: int) -> float:
    """RSS of the server: the API process and its children (the engine core; with several API servers, the
    supervisor, the core and the servers)."""
    total = 0.0
    for p in [pid, *child_pids(pid)]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: Path, api_servers: int = 1) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--device", "cpu",
           "--attention-backend", "torch", "--num-blocks", "256", "--max-num-seqs", "16",
           "--shutdown-timeout", "2", "--api-server-count", str(api_servers)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: proc.poll() is None, 120)
    except ServerNotHealthy as e:
        proc.kill()
        raise SystemExit(f"{e}:\n{log_path.read_text()}") from None
    return proc, url


def wait_idle(url: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{url}/health", timeout=5).json()
        idle = h["running"] == 0 and h["waiting"] == 0 and h["kv_cache"]["used_blocks"] == 0
        if idle or time.monotonic() > deadline:
            return {**h, "idle": idle}
        time.sleep(0.1)


def soak(duration: float, concurrency: int, seed: int, url: str | None, out: Path | None,
         api_servers: int = 1) -> dict:
    log = Path(tempfile.mkdtemp(prefix="pagewalk-soak-")) / "server.log"
    proc = None
    if url is None:
        proc, url = start_server(log, api_servers)
    pid = proc.pid if proc else None
    rss_start = rss_mb(pid) if pid else float("nan")
    stats = asyncio.run(drive(url, duration, concurrency, seed))
    health = wait_idle(url)
    rss_end = rss_mb(pid) if pid else float("nan")
    exit_code = None
    if proc is not None:
        proc.terminate()
        exit_code = proc.wait(timeout=30)
    lat = sorted(stats["latencies"]) or [float("nan")]
    result = {
        "duration_s": duration, "concurrency": concurrency, "api_servers": api_servers,
        "served": stats["served"],
        "hangups": stats["hangups"], "errors": dict(stats["errors"]),
        "p50_s": lat[len(lat) // 2], "p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "rss_start_mb": rss_start, "rss_end_mb": rss_end, "idle_at_end": health["idle"],
        "exit_code": exit_code, "tracebacks": log.read_text().count("Traceback") if proc else None,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(result, indent=2))
    return result


def print_table(r: dict) -> None:
    errors = ", ".join(f"{k}={v}" for k, v in sorted(r["errors"].items())) or "none"
    rows = [("duration", f"{r['duration_s']:.0f} s x {r['concurrency']} workers"),
            ("requests served", r["served"]), ("hang-ups", r["hangups"]), ("errors", errors),
            ("latency p50 / p99", f"{r['p50_s'] * 1000:.0f} / {r['p99_s'] * 1000:.0f} ms"),
            ("RSS start / end (+core)", f"{r['rss_start_mb']:.0f} / {r['rss_end_mb']:.0f} MB"),
            ("idle at end", r["idle_at_end"]), ("exit code", r["exit_code"]), ("tracebacks", r["tracebacks"])]
    for k, v in rows:
        print(f"{k:<24}{v}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--out", type=Path, default=None, help="directory for soak.json")
    p.add_argument("--api-server-count", type=int, default=1, help="the server's --api-server-count")
    args = p.parse_args(argv)
    r = soak(args.duration, args.concurrency, args.seed, args.url, args.out, args.api_server_count)
    print_table(r)
    ok = not r["errors"] and r["idle_at_end"] and r["exit_code"] in (0, None) and not r["tracebacks"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
