"""Drive a workload: send requests at their arrival offsets, keep at most `concurrency` in flight.

A request's clock starts when it gets a concurrency slot (as in vLLM's `bench serve`), so TTFT measures
the server, not the client's own queue. Setting `stop` (Ctrl-C) cancels what is in flight and returns the
records of the requests that had finished, with `interrupted=True`. Offsets count from `start_at` (a
`time.perf_counter()` time, now by default), which lets several processes share one arrival schedule
(processes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from loadtest.client import ClientConfig, RequestRecord, send_request
from loadtest.cpu import LoadMeter, ProcessLoad
from loadtest.workload import RequestSpec

POOL_CONNECTIONS = 16


@dataclass
class BenchmarkRun:
    records: list[RequestRecord]  # finished requests (successful or failed), in completion order
    num_requested: int
    concurrency: int
    interrupted: bool = False
    loads: list[ProcessLoad] = field(default_factory=list)  # the load generator's CPU, one per process

    @property
    def start_time(self) -> float:
        return min((r.send_time for r in self.records), default=0.0)

    @property
    def end_time(self) -> float:
        return max((r.end_time for r in self.records), default=0.0)

    @property
    def duration_s(self) -> float:
        """First send to last completion."""
        return self.end_time - self.start_time


def make_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    """One async client whose connection pool matches the number of requests allowed in flight."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)))


@contextlib.asynccontextmanager
async def open_clients(concurrency: int, timeout_s: float) -> AsyncIterator[list[httpx.AsyncClient]]:
    """Clients for `concurrency` slots, POOL_CONNECTIONS at most each (run_benchmark: slot s, client s % n).

    httpcore's pool scans every connection (and, for each idle one, every connection again) whenever a
    request starts or ends, so one pool of hundreds of connections costs more CPU than the streams it reads.
    """
    n = math.ceil(concurrency / POOL_CONNECTIONS)
    async with contextlib.AsyncExitStack() as stack:
        shares = [len(range(k, concurrency, n)) for k in range(n)]
        yield [await stack.enter_async_context(make_client(share, timeout_s)) for share in shares]


def in_order(num_requests: int) -> Callable[[], int | None]:
    """Claims of one process: request indices 0, 1, ... then None."""
    indices = iter(range(num_requests))
    return lambda: next(indices, None)


async def run_benchmark(
    client: httpx.AsyncClient | list[httpx.AsyncClient],
    specs: list[RequestSpec],
    cfg: ClientConfig,
    concurrency: int,
    offsets: list[float],
    stop: asyncio.Event | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    start_at: float | None = None,
    claim: Callable[[], int | None] | None = None,
) -> BenchmarkRun:
    """`concurrency` slots, each sending one request at a time: a free slot claims the next request index
    (`claim`; in order by default) and sends it at its arrival offset, so request j goes out at its offset
    or, when every slot is busy then, as the first slot frees. Worker processes pass a claim shared by all of
    them (processes.py), so their slots together behave as the slots of one process."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    run = BenchmarkRun(records=[], num_requested=len(specs), concurrency=concurrency)
    clients = client if isinstance(client, list) else [client]
    claim = claim or in_order(len(specs))
    t0 = time.perf_counter() if start_at is None else start_at

    async def slot(s: int) -> None:
        while (j := claim()) is not None:
            delay = t0 + offsets[j] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = await send_request(clients[s % len(clients)], specs[j], cfg)
            run.records.append(rec)
            if on_record is not None:
                on_record(rec)

    tasks = [asyncio.create_task(slot(s)) for s in range(concurrency)]
    slots = asyncio.gather(*tasks)  # done when all are, or at the first that raises
    stopper = asyncio.create_task(stop.wait()) if stop is not None else None
    await asyncio.wait([t for t in (slots, stopper) if t is not None], return_when=asyncio.FIRST_COMPLETED)
    run.interrupted = not slots.done()
    for task in tasks:  # (after a slot raised, the finished gather would cancel none of the others)
        task.cancel()
    await asyncio.gather(slots, *tasks, return_exceptions=True)  # the gather's own end read, not logged
    if stopper is not None:
        stopper.cancel()
    if not run.interrupted and slots.exception() is not None:
        raise slots.exception()
    return run


async def drive(
    specs: list[RequestSpec],
    cfg: ClientConfig,
    concurrency: int,
    offsets: list[float],
    stop: asyncio.Event | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> BenchmarkRun:
    """run_benchmark with clients of its own, recording this process's CPU over the run."""
    async with open_clients(concurrency, cfg.timeout_s) as clients:
        meter = LoadMeter("driver")
        run = await run_benchmark(clients, specs, cfg, concurrency, offsets, stop, on_record)
        run.loads.append(meter.stop())
    return run
