"""`--processes N`: a run's requests split over N worker processes, each an asyncio loop with its own client.

One asyncio process reads about 15K SSE events a second at full CPU (httpx's HTTP/1.1 stack costs most of
it, see sse.py), below the token rates of a fast server, so the work is spread:
- slot s belongs to worker s % N, so each worker holds its share of the concurrency (the shares sum to C);
- a free slot of any worker claims the next request index from one counter the workers share (a
  multiprocessing Value), so the slots of all workers take requests in order as the slots of one process
  do: no request waits for a slot of its own worker while another worker's slot is free (a review found
  requests tied to workers losing a quarter of the throughput with uneven output lengths);
- every worker sends its claimed requests at their global arrival offsets from one start time the parent
  hands out once all workers are up (`time.perf_counter` is CLOCK_MONOTONIC on Linux, one clock for every
  process of the host; startup checks it), and sends each record back as it finishes;
- the parent merges the records into one BenchmarkRun, so the metrics are computed exactly as for one
  process (the duration is first send to last completion over all workers), and the run's `loads` hold
  every worker's CPU and the parent's own.
Ctrl-C: workers ignore SIGINT (a terminal sends it to the whole process group); the parent's stop reaches
them as a message and each returns the records that had finished. A worker that dies fails the run.

`--processes auto` = max(1, min(ceil(C / 8), usable CPUs // 2)): one process reads about 12K SSE events a
second at 80% of a core (measured on the H200 host, 2026-12-01: 1 process at 16 streams x 620 tok/s was
78-84% busy, 2 processes at 64 streams x 420 tok/s 84%), so a process per 8 streams stays near a third of a
core at the serving targets' rates (up to ~600 tokens a second per stream); half the cores stay for the
server when it shares the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

from loadtest.benchmark import BenchmarkRun, drive, open_clients, run_benchmark
from loadtest.client import ClientConfig, RequestRecord, fetch_text
from loadtest.cpu import LoadMeter
from loadtest.workload import RequestSpec

STREAMS_PER_PROCESS = 8
START_MARGIN_S = 0.2  # from handing out the start time to the first send: every worker is waiting
CLOCK_SKEW_LIMIT_S = 10.0  # a worker's clock reading, received by the parent, is at most this old


class WorkerError(RuntimeError):
    """A worker process failed, so the run's records are incomplete."""


def auto_processes(concurrency: int, cpus: int | None = None) -> int:
    """`--processes auto`; `cpus` defaults to the CPUs this process may run on (a container's affinity)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(math.ceil(concurrency / STREAMS_PER_PROCESS), cpus // 2))


def concurrency_shares(num_requests: int, concurrency: int, processes: int) -> list[int]:
    """Slots per worker (slot s on worker s % n); never more workers than slots or requests."""
    n = max(1, min(processes, concurrency, num_requests))
    return [len(range(w, concurrency, n)) for w in range(n)]


def shared_claim(counter, num_requests: int) -> Callable[[], int | None]:
    """Claims from a counter every worker holds (multiprocessing.Value): the next request index, or None."""

    def claim() -> int | None:
        with counter.get_lock():
            j = counter.value
            if j >= num_requests:
                return None
            counter.value = j + 1
        return j

    return claim


async def run_workload(
    specs: list[RequestSpec],
    cfg: ClientConfig,
    concurrency: int,
    offsets: list[float],
    processes: int,
    stop: asyncio.Event | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> BenchmarkRun:
    """The whole workload at `concurrency`, in this process (processes=1) or spread over worker processes."""
    shares = concurrency_shares(len(specs), concurrency, processes)
    if len(shares) == 1:
        return await drive(specs, cfg, concurrency, offsets, stop, on_record)
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)  # the next request index to claim (shared_claim)
    workers = []
    finished = False
    try:
        for share in shares:
            conn, child = ctx.Pipe()
            args = (child, specs, offsets, cfg, share, counter)
            proc = ctx.Process(target=_worker_main, args=args, daemon=True, name="loadtest-worker")
            with _sigint_ignored():
                proc.start()
            child.close()
            workers.append((proc, conn))
        run = await _supervise(workers, stop, on_record)
        finished = True
    finally:
        for proc, conn in workers:
            conn.close()  # a worker still waiting for its start time reads EOF and exits
            proc.join(timeout=5.0 if finished else 0.5)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    run.num_requested, run.concurrency = len(specs), concurrency
    return run


async def _supervise(workers, stop: asyncio.Event | None, on_record) -> BenchmarkRun:
    """Start the workers together, forward their records, stop them on `stop`; the merged run."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    for w, (_, conn) in enumerate(workers):
        loop.add_reader(conn.fileno(), _forward, conn, w, inbox)
    stopper = asyncio.create_task(stop.wait()) if stop is not None else None
    run = BenchmarkRun(records=[], num_requested=0, concurrency=0)
    try:
        ready = 0
        while ready < len(workers):
            w, msg = await _next(inbox, stopper)
            if msg is None:  # stopped before the start
                run.interrupted = True
                return run
            _check(workers, w, msg, "ready")
            if not 0.0 <= time.perf_counter() - msg[1] < CLOCK_SKEW_LIMIT_S:
                raise WorkerError("perf_counter is not one clock across processes here: use --processes 1")
            ready += 1
        start_at = time.perf_counter() + START_MARGIN_S
        meter = LoadMeter("parent", start_at)
        for _, conn in workers:
            conn.send(start_at)
        if stopper is not None:
            stopper.add_done_callback(lambda t: t.cancelled() or _send_stop(workers))
        done: set[int] = set()
        while len(done) < len(workers):
            w, msg = await _next(inbox, None)
            if msg[0] == "record":
                run.records.append(msg[1])
                if on_record is not None:
                    on_record(msg[1])
            elif w not in done:  # a finished worker's end of file is expected
                _check(workers, w, msg, "done")
                run.interrupted |= msg[1]
                run.loads.append(msg[2])
                done.add(w)
        run.loads.append(meter.stop())
        return run
    finally:
        for _, conn in workers:
            loop.remove_reader(conn.fileno())
        if stopper is not None:
            stopper.cancel()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """An ignored signal stays ignored across exec: a worker starts immune to a Ctrl-C sent to the group."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: the signal goes to the main thread's handler anyway
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _forward(conn: Connection, w: int, inbox: asyncio.Queue) -> None:
    try:
        inbox.put_nowait((w, conn.recv()))
    except (EOFError, OSError):
        asyncio.get_running_loop().remove_reader(conn.fileno())
        inbox.put_nowait((w, ("exit",)))


async def _next(inbox: asyncio.Queue, stopper: asyncio.Task | None) -> tuple[int, tuple | None]:
    """The next worker message, or (-1, None) once `stopper` is done."""
    if stopper is None:
        return await inbox.get()
    getter = asyncio.ensure_future(inbox.get())
    await asyncio.wait([getter, stopper], return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return -1, None


def _check(workers, w: int, msg: tuple, expected: str) -> None:
    if msg[0] != expected:
        proc, _ = workers[w]
        proc.join(timeout=1.0)
        raise WorkerError(f"load generator worker {w} exited (code {proc.exitcode}) before '{expected}'")


def _send_stop(workers) -> None:
    for _, conn in workers:
        try:
            conn.send("stop")
        except OSError:
            pass  # that worker has already finished and gone


async def warm_clients(clients, cfg: ClientConfig) -> None:
    """One GET /health on each client: a fresh process's first httpx request costs ~15-18 ms more than the
    next (lazy imports and first-use set-up, measured on the 2-core CI box), which would land in the TTFT of
    each worker's first measured request and delay its later sends; it also opens each pool's connection."""
    await asyncio.gather(*(fetch_text(c, cfg.base_url, "/health", cfg.api_key) for c in clients))


def _worker_main(conn: Connection, specs, offsets, cfg: ClientConfig, concurrency: int, counter) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop (inherited, made sure)
    try:
        run = asyncio.run(_worker(conn, specs, offsets, cfg, concurrency, shared_claim(counter, len(specs))))
        if run is not None:
            conn.send(("done", run.interrupted, run.loads[0]))
    except (BrokenPipeError, EOFError):
        pass  # the parent has gone (or stopped during startup): nothing left to report to
    conn.close()


async def _worker(conn: Connection, specs, offsets, cfg, concurrency: int, claim) -> BenchmarkRun | None:
    """Ready (loop and clients built and warm, so the first send is on time), wait for the start, run its
    slots on the requests they claim."""
    async with open_clients(concurrency, cfg.timeout_s) as clients:
        await warm_clients(clients, cfg)
        conn.send(("ready", time.perf_counter()))
        try:
            start_at = conn.recv()  # blocking is fine: nothing runs in this loop yet
        except EOFError:
            return None  # the parent stopped before the start
        meter = LoadMeter("driver", start_at)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_message() -> None:  # after the start time the only message is "stop" (or the parent's EOF)
            loop.remove_reader(conn.fileno())
            stop.set()

        loop.add_reader(conn.fileno(), on_message)
        send = lambda rec: conn.send(("record", rec))
        try:
            run = await run_benchmark(clients, specs, cfg, concurrency, offsets, stop, send, start_at, claim)
        finally:
            loop.remove_reader(conn.fileno())
        run.loads.append(meter.stop())
    return run
