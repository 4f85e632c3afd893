"""The API process's own CPU cost per streamed token, against a synthetic engine core: \
`python -m tools.api_bench`.

`pagewalk serve --model tiny` runs as it ships (uvicorn, FastAPI, the AsyncEngine, the ZeroMQ link to a
core process) except for what the core process builds: a SyntheticCore that runs no model. Every
`--step-ms` it gives each running choice one token (printable ids of the tiny tokenizer, so the
detokenizer, the SSE encoding and the client do their real work) and ends it at max_tokens; it answers
stats queries and aborts as the real core does. The device is out of the picture, so what is timed is the
API process: its CPU seconds (every thread, from /proc) over a run at each concurrency, divided
by the tokens streamed, gives its cost per token and the token rate one API process can carry at 100% of a
core. The client is a lean raw-socket one in this process (it counts `data: ` and parses nothing), so that on
a small machine the API process, not the client, sets the pace; how many tokens one SSE
event carries then depends on the API process alone (it merges what arrived while it was busy), and the
table gives the cost per event as well as per token.

Prints one table last; writes the reports as JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

from server.engine.outputs import CoreStats, EngineRequest, SeqUpdate, StepUpdate
from server.engine.wire import CoreInfo
from tools.server_load import child_pids, cpu_seconds
from tools.server_wait import wait_healthy

STEP_ENV = "PAGEWALK_API_BENCH_STEP_MS"
CORE_PID_ENV = "PAGEWALK_API_BENCH_CORE_PID_FILE"  # the synthetic core writes its pid there


class SyntheticCore:
    """The EngineCore interface CoreLoop uses, with a fixed step time and no model."""

    def __init__(self, token_ids: list[int], step_s: float):
        self.token_ids, self.step_s = token_ids, step_s
        self.requests: dict[str, tuple[EngineRequest, list[int]]] = {}  # id -> (request, tokens per choice)
        self.next_step = time.monotonic()
        self.steps = 0
        self.fatal: str | None = None  # (EngineCore's: a synthetic step never fails)

    def add_request(self, er: EngineRequest) -> None:
        if er.request_id in self.requests:
            raise ValueError(f"request id {er.request_id!r} is already in the engine")
        self.requests[er.request_id] = (er, [0] * er.params.n)

    def abort_request(self, request_id: str, index: int | None = None, reason: str = "abort",
                      error: str | None = None) -> list[SeqUpdate]:
        entry = self.requests.get(request_id)
        if entry is None:
            return []
        er, counts = entry
        indices = range(er.params.n) if index is None else [index]
        updates = [SeqUpdate(request_id, i, [], None, reason, None, error) for i in indices if counts[i] >= 0]
        for i in indices:
            counts[i] = -1
        if all(c < 0 for c in counts):
            del self.requests[request_id]
        return updates

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self) -> StepUpdate:
        delay = self.next_step - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self.next_step = max(self.next_step, time.monotonic() - self.step_s) + self.step_s
        now, updates, tokens = time.monotonic(), [], 0
        for rid, (er, counts) in list(self.requests.items()):
            for i, done in enumerate(counts):
                if done < 0:
                    continue
                tok = self.token_ids[(self.steps + i + done) % len(self.token_ids)]
                counts[i] = done + 1
                finished = counts[i] >= er.params.max_tokens
                updates.append(SeqUpdate(rid, i, [tok], None, "length" if finished else None,
                                         scheduled_time=now if done == 0 else None))
                tokens += 1
                if finished:
                    counts[i] = -1
            if all(c < 0 for c in counts):
                del self.requests[rid]
        self.steps += 1
        return StepUpdate(updates, self.stats(num_decode_tokens=tokens))

    def stats(self, num_prefill_tokens: int = 0, num_decode_tokens: int = 0) -> CoreStats:
        return CoreStats(len(self.requests), 0, 1 << 20, 0, 0, 0.0, num_prefill_tokens, num_decode_tokens)

    def running_request_ids(self) -> set[str]:
        return set(self.requests)

    def kv_snapshot(self) -> dict:
        return {"blocks": []}


def synthetic_build_core(config):
    from server.model.loader import load_tokenizer

    tok = load_tokenizer(config.model, config.tokenizer, config.chat_template)
    vocab = 259 if config.model == "tiny" else tok.vocab_size
    printable = [i for i in range(vocab) if len(s := tok.decode([i])) == 1 and s.isprintable()]
    core = SyntheticCore(printable, float(os.environ.get(STEP_ENV, "1.5")) / 1e3)
    info = CoreInfo(model=config.model, device="synthetic", dtype="none", attention_backend="none",
                    cuda_graphs=False, block_size=16, num_blocks=1 << 20, capacity_tokens=16 << 20,
                    max_model_len=config.max_model_len or 4096, vocab_size=vocab)
    return core, info


def synthetic_core_process(config, address: str, log_level: str, parent: int | None = None) -> None:
    """The core process's own entry (server.engine.core_process), building a SyntheticCore instead."""
    from server.engine import core_process

    Path(os.environ[CORE_PID_ENV]).write_text(str(os.getpid()))
    core_process.build_core = synthetic_build_core
    core_process.run_core_process(config, address, log_level, parent)


def api_cpu_seconds(pid: int, core_pid_file: Path) -> float:
    """CPU seconds of the API process `pid`, or with several API servers of all of them: the processes
    `pid` started (the supervisor's children) but the core."""
    core = int(core_pid_file.read_text())
    servers = [p for p in child_pids(pid) if p != core]
    return sum(cpu_seconds(p) or 0.0 for p in servers) if servers else cpu_seconds(pid)


def serve(argv: list[str], profile: str | None) -> None:
    """The API process: `pagewalk serve` with the synthetic core process; `profile`: write the event
    loop's cProfile stats there at exit."""
    from server import cli
    from server.engine import core_client

    core_client.run_core_process = synthetic_core_process
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        exit_now = cli.exit_now

        def dump_and_exit(code: int):
            profiler.disable()
            profiler.dump_stats(profile)
            exit_now(code)

        cli.exit_now = dump_and_exit
        profiler.enable()
    sys.exit(cli.main(argv))


async def stream_one(port: int, body: bytes) -> int:
    """One streamed completion over its own connection -> the number of SSE data events (the [DONE] one
    excluded). Counts `data: ` across read boundaries without parsing the chunked framing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    events, tail = 0, b""
    while data := await reader.read(1 << 16):
        window = tail + data
        events += window.count(b"data: ") - tail.count(b"data: ")
        if b"data: [DONE]" in window:
            break
        tail = window[-16:]
    writer.close()
    return events - 1


async def drive(port: int, concurrency: int, num_requests: int, output_len: int,
                input_len: int = 0) -> int:
    # input_len > 0: a prompt of that many token ids (printable ASCII of the tiny byte vocabulary), as the
    # load generator sends them; else the text "hello"
    prompt = [65 + i % 26 for i in range(input_len)] if input_len else "hello"
    body = json.dumps({"prompt": prompt, "max_tokens": output_len, "stream": True,
                       "ignore_eos": True}).encode()
    left = iter(range(num_requests))

    async def worker() -> int:
        return sum([await stream_one(port, body) for _ in iter(lambda: next(left, None), None)])

    return sum(await asyncio.gather(*(worker() for _ in range(concurrency))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=0,
                    help="prompt token ids per request (0: the text 'hello')")
    ap.add_argument("--step-ms", type=float, default=1.5, help="the synthetic core's step time")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="API server processes (their CPU is summed; the supervisor's is ~0)")
    ap.add_argument("--port", type=int, default=8017)
    ap.add_argument("--out", type=Path, default=Path("api_bench.json"))
    ap.add_argument("--profile", help="write the API event loop's cProfile stats to this file")
    args = ap.parse_args()
    os.environ[STEP_ENV] = str(args.step_ms)
    core_pid_file = args.out.with_suffix(".core_pid")
    os.environ[CORE_PID_ENV] = str(core_pid_file)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    ctx = multiprocessing.get_context("spawn")
    server = ctx.Process(target=serve, args=(["serve", "--model", "tiny", "--port", str(args.port),
                                              "--max-num-seqs", "1024", "--log-level", "warning",
                                              "--api-server-count", str(args.api_server_count)],
                                             args.profile))
    server.start()
    results = []
    try:
        wait_healthy(url, server.is_alive, 120)
        for c in args.levels:
            asyncio.run(drive(args.port, c, min(8, c), args.output_len, args.input_len))  # warm-up
            cpu0, t0 = api_cpu_seconds(server.pid, core_pid_file), time.perf_counter()
            events = asyncio.run(drive(args.port, c, args.num_requests, args.output_len, args.input_len))
            cpu, wall = api_cpu_seconds(server.pid, core_pid_file) - cpu0, time.perf_counter() - t0
            tokens = args.num_requests * args.output_len
            results.append({"concurrency": c, "output_tok_s": tokens / wall, "events": events,
                            "tokens_per_event": tokens / events, "api_cpu_s": cpu, "wall_s": wall,
                            "api_busy": cpu / wall, "api_us_per_token": cpu / tokens * 1e6,
                            "api_us_per_event": cpu / events * 1e6, "api_tok_s_per_core": tokens / cpu})
    finally:
        if server.pid is not None:
            os.kill(server.pid, 15)
        server.join(30)
    meta = {"cpus": os.cpu_count(), "step_ms": args.step_ms, "output_len": args.output_len,
            "api_server_count": args.api_server_count,
            "input_len": args.input_len,
            "num_requests": args.num_requests}
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\n{args.api_server_count} API process(es) against a synthetic core ({args.step_ms} ms steps), "
          f"tiny tokenizer, {args.output_len} tokens per request, {os.cpu_count()} CPUs")
    print(f"{'conc':>5} {'tok/s':>9} {'tok/event':>10} {'API busy':>9} {'API us/event':>13} "
          f"{'API us/tok':>11} "
          f"{'tok/s/core':>11}")
    for r in results:
        print(f"{r['concurrency']:>5} {r['output_tok_s']:>9.0f} {r['tokens_per_event']:>10.2f} "
              f"{r['api_busy']:>9.0%} {r['api_us_per_event']:>13.1f} {r['api_us_per_token']:>11.1f} "
              f"{r['api_tok_s_per_core']:>11.0f}")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
