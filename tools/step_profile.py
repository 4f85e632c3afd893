"""Host cost of one decode step at 64 streams, model forward excluded: `python -m tools.step_profile`.

Builds the real AsyncEngine + ASGI app (`tiny` preset, CPU), drives N concurrent streaming completions
through httpx.ASGITransport, and wraps `runner.execute` (on the instance, runner.py untouched) to time each
forward. For every pair of consecutive full-batch decode steps:
- wall host ms = (start of next execute - start of this one) - this execute's duration;
- cpu host ms  = engine-thread CPU between the two starts minus the execute's own thread CPU, plus the
  event-loop thread's CPU over the same interval (the two share the GIL: their sum bounds the step rate
  when the device is fast).
Medians are reported. A second run per mode records cProfile top-N of the engine thread (execute excluded)
and of the event loop. `--digest` prints a hash of every stream's choices (seeded sampling) so a change
can be checked to keep the output bytes identical.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import io
import json
import pstats
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

from server.api.app import create_app
from server.api.async_engine import AsyncEngine
from server.engine.engine import EngineConfig

MODES = {"greedy": {"temperature": 0.0}, "sample": {"temperature": 0.8, "top_p": 0.95}}


@dataclass
class StepTimer:
    """Thin wrapper around runner.execute recording, per full decode step, wall and CPU clocks."""

    batch: int
    loop_thread: int
    profiler: cProfile.Profile | None = None
    starts: list[tuple[float, float, float]] = field(default_factory=list)  # (wall, engine cpu, loop cpu)
    durations: list[tuple[float, float]] = field(default_factory=list)  # (wall, engine cpu) of execute
    steps: int = 0

    def install(self, runner) -> None:
        inner = runner.execute
        loop_clock = time.pthread_getcpuclockid(self.loop_thread)

        def execute(step, table_of, token_mask=None):
            full = len(step.decodes) == self.batch and not step.prefills
            if self.profiler is not None:
                self.profiler.disable()
            t0, c0 = time.perf_counter(), time.thread_time()
            if full:
                self.starts.append((t0, c0, time.clock_gettime(loop_clock)))
            try:
                return inner(step, table_of, token_mask)
            finally:
                if full:
                    self.durations.append((time.perf_counter() - t0, time.thread_time() - c0))
                    self.steps += 1
                else:  # a prefill step breaks the chain of consecutive decode steps
                    self.starts.append((float("nan"),) * 3)
                    self.durations.append((float("nan"),) * 2)
                if self.profiler is not None:
                    self.profiler.enable()

        runner.execute = execute

    def host_ms(self) -> tuple[float, ...]:
        """Medians over consecutive decode-step pairs, ms: wall host, engine cpu, loop cpu, execute wall."""
        wall, eng, loop, exe = [], [], [], []
        for i in range(len(self.starts) - 1):
            (w0, e0, l0), (w1, e1, l1) = self.starts[i], self.starts[i + 1]
            dw, dc = self.durations[i]
            if w0 != w0 or w1 != w1:  # nan: not two decode steps in a row
                continue
            wall.append(w1 - w0 - dw)
            eng.append(e1 - e0 - dc)
            loop.append(l1 - l0)
            exe.append(dw)
        if not wall:
            return (float("nan"),) * 4
        return tuple(1e3 * statistics.median(x) for x in (wall, eng, loop, exe))


def build(streams: int, max_tokens: int) -> AsyncEngine:
    blocks = streams * (-(-(max_tokens + 64) // 16)) + 64
    return AsyncEngine(EngineConfig(model="tiny", device="cpu", dtype="float32", attention_backend="torch",
                                    num_blocks=blocks, max_num_seqs=streams, max_num_batched_tokens=4096),
                       in_process=True)  # the runner is patched in place: the core runs on a thread


async def one_stream(client: httpx.AsyncClient, body: dict) -> bytes:
    async with client.stream("POST", "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        return b"".join([chunk async for chunk in r.aiter_bytes()])


async def drive(app, streams: int, body: dict) -> list[bytes]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        bodies = [dict(body, prompt=f"Stream {i}: once upon a time", **_seed(body, i))
                  for i in range(streams)]
        return await asyncio.gather(*(one_stream(client, b) for b in bodies))


def _seed(body: dict, i: int) -> dict:
    return {"seed": 1000 + i} if body.get("seed") else {}


def run_mode(engine: AsyncEngine, app, streams: int, body: dict, profile: bool) -> tuple[StepTimer, list]:
    """One batch of streams; with `profile`, cProfile on the engine thread and on the event loop."""
    timer = StepTimer(streams, threading.get_ident())
    loop_prof = cProfile.Profile() if profile else None
    if profile:
        timer.profiler = cProfile.Profile()
    original = engine.client.core.runner.execute
    timer.install(engine.client.core.runner)
    try:
        if loop_prof:
            loop_prof.enable()
        out = asyncio.run(drive(app, streams, body))
        if loop_prof:
            loop_prof.disable()
    finally:
        engine.client.core.runner.execute = original
    return timer, [out, loop_prof]


def top(prof: cProfile.Profile, n: int) -> str:
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    for key in [k for k in stats.stats if "disable" in k[2] and "_lsprof" in k[2]]:
        del stats.stats[key]  # its time is the excluded execute
    stats.strip_dirs().sort_stats("tottime").print_stats(n)
    lines = s.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(lines[start - 1:])


def digest(outs: list[bytes]) -> str:
    """Hash of every stream's choices (id and created stripped) in order."""
    h = hashlib.sha256()
    for raw in outs:
        for ev in raw.decode().split("\n\n"):
            if ev.startswith("data: {"):
                h.update(json.dumps(json.loads(ev[6:])["choices"]).encode())
            h.update(b"|")
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--digest", action="store_true", help="print output hashes (greedy and seeded)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per mode (the best median is kept)")
    args = ap.parse_args()
    engine = build(args.streams, args.max_tokens)
    app = create_app(engine)
    engine.start()
    try:
        base = {"max_tokens": args.max_tokens, "ignore_eos": True, "stream": True}
        if args.digest:
            for name, extra in {**MODES, "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 1}}.items():
                _, (outs, _) = run_mode(engine, app, args.streams, {**base, **extra}, False)
                print(f"digest {name}: {digest(outs)}")
            return
        rows, profiles = [], {}
        for name, extra in MODES.items():
            body = {**base, **extra}
            run_mode(engine, app, args.streams, body, False)  # warm-up
            timers = [run_mode(engine, app, args.streams, body, False)[0] for _ in range(args.repeat)]
            best = min(timers, key=lambda t: t.host_ms()[1] + t.host_ms()[2])
            rows.append((name, best.steps, *best.host_ms()))
        # profiled runs last: the engine thread's profiler is only switched off by the next run's first step
        for name, extra in MODES.items() if not args.no_profile else ():
            timer, (_, loop_prof) = run_mode(engine, app, args.streams, {**base, **extra}, True)
            profiles[name] = (timer.profiler, loop_prof)
        for name, (eng_prof, loop_prof) in profiles.items():
            print(f"\n==== {name}: engine thread (execute excluded), top {args.top} by tottime ====")
            print(top(eng_prof, args.top))
            print(f"\n==== {name}: event loop, top {args.top} by tottime ====")
            print(top(loop_prof, args.top))
        print(f"\n{args.streams} streams x {args.max_tokens} tokens, tiny preset on CPU, "
              "medians per decode step")
        print("host cpu = engine-thread cpu (execute excluded) + event-loop cpu; they share the GIL")
        print(f"{'mode':8} {'steps':>6} {'host cpu ms':>12} {'engine ms':>10} {'loop ms':>8} "
              f"{'host wall ms':>13} {'execute ms':>11}")
        for name, steps, wall, eng, loop, exe in rows:
            print(f"{name:8} {steps:6d} {eng + loop:12.2f} {eng:10.2f} {loop:8.2f} {wall:13.2f} {exe:11.2f}")
    finally:
        engine.shutdown(timeout=5)


if __name__ == "__main__":
    main()
