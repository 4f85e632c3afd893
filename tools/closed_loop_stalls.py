"""Where a closed loop's slow steps stall the host: `python -m tools.closed_loop_stalls`.

engine_step_bench's closed loop (C requests of --prompt-len in / --output-len out kept in flight on one
EngineCore built as `pagewalk serve` builds it, its start-up heap frozen as the core process does) runs once
to warm up, then again under torch.profiler (CPU and CUDA runtime activity). Printed last: the loop's slow
calls (wall > --slow-ms) with their schedule / execute / wait split, and the CUDA runtime calls and CPU ops
that took longer than --slow-ms inside the profiled run (a synchronising call, a pinned allocation, a
JIT compile show there), and the Python stacks of the runner's launches (`execute`) that ran past
--stall-ms: faulthandler's watchdog thread dumps them every --stall-ms while a launch lasts, without the GIL,
so a C call that holds it (a cuBLAS or CUDA driver call inside a torch op) shows as the frame that made it.
Details as JSON under --out.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from server.engine.engine import EngineConfig, build_core
from server.heap import freeze_startup_heap
from tools.engine_step_bench import Probe, closed_loop

ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                    "num_ooms")


def _pinned_blocks() -> int:
    """Pinned host blocks the host caching allocator has taken (cudaHostAlloc), all time."""
    return torch.cuda.host_memory_stats().get("allocations.allocated", 0)


class CallWatch:
    """Wraps core.step and numbers its calls; records, per call, what can stall the host inside it: device
    memory taken by the caching allocator, pinned host blocks taken by the host allocator, Triton compiles
    (jit cache misses), the collector's runs (gc
    callbacks, with their generation and duration). events: (call, kind, detail, ms)."""

    def __init__(self, core, stall_ms: float) -> None:
        self.events: list[tuple[int, str, str, float]] = []
        self.call = 0
        self._gc_start = 0.0
        self._dumps = tempfile.TemporaryFile("w+")  # faulthandler writes to its descriptor
        self._watch_launches(core.runner, stall_ms / 1e3)
        step = core.step

        def watched():
            before = torch.cuda.memory_stats().get("num_device_alloc", 0)
            pinned = _pinned_blocks()
            t0 = time.perf_counter()
            out = step()
            wall = (time.perf_counter() - t0) * 1e3
            new = torch.cuda.memory_stats().get("num_device_alloc", 0) - before
            if new:
                self.events.append((self.call, "device_alloc", f"{new} segments", round(wall, 3)))
            if (new_pinned := _pinned_blocks() - pinned):
                self.events.append((self.call, "pinned_alloc", f"{new_pinned} blocks", round(wall, 3)))
            self.call += 1
            return out

        core.step = watched
        triton.knobs.runtime.jit_cache_hook = self._on_compile
        gc.callbacks.append(self._on_gc)

    def _watch_launches(self, runner, stall_s: float) -> None:
        """Wraps runner.execute: a launch that lasts past stall_s has its stacks dumped every stall_s by
        faulthandler's watchdog (a C thread, so a call holding the GIL does not hide it); the main thread's
        innermost frames become a 'stalled_launch' event."""
        execute, dumps = runner.execute, self._dumps

        def watched_execute(*args, **kwargs):
            start = os.fstat(dumps.fileno()).st_size
            t0 = time.perf_counter()
            faulthandler.dump_traceback_later(stall_s, repeat=True, file=dumps)
            try:
                return execute(*args, **kwargs)
            finally:
                faulthandler.cancel_dump_traceback_later()
                if os.fstat(dumps.fileno()).st_size > start:
                    dumps.seek(start)
                    ms = round((time.perf_counter() - t0) * 1e3, 3)
                    for stack in _launch_stacks(dumps.read()):
                        self.events.append((self.call, "stalled_launch", stack, ms))
                    dumps.seek(0, os.SEEK_END)

        runner.execute = watched_execute

    def _on_compile(self, *, repr: str, **_) -> None:  # noqa: A002 (Triton's keyword)
        self.events.append((self.call, "triton_compile", repr[:160], 0.0))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_start) * 1e3
        if info["generation"] == 2 or ms > 0.5:
            self.events.append((self.call, "gc", f"generation {info['generation']}", round(ms, 3)))

    def take(self) -> list[tuple[int, str, str, float]]:
        """The events so far (the list is emptied and the call count restarts)."""
        events, self.events, self.call = self.events, [], 0
        return events


def _launch_stacks(dump: str, frames: int = 6) -> list[str]:
    """The main thread's innermost frames (most recent first) in each of faulthandler's dumps: the thread
    block whose frames pass through watched_execute."""
    stacks = []
    for block in re.split(r"^(?:Timeout \(.*\)!|Thread 0x\w+ .*|Current thread 0x\w+ .*)$", dump,
                          flags=re.MULTILINE):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
        if any("watched_execute" in ln for ln in lines):
            stacks.append(" <- ".join(ln.replace("File ", "").replace('"', "") for ln in lines[:frames]))
    return stacks


def _distinct_stacks(events: list[tuple]) -> list[tuple]:
    """The stalled_launch events, one per (call, stack): a stall repeats its stack every dump."""
    seen, out = set(), []
    for e in events:
        if e[1] == "stalled_launch" and (e[0], e[2]) not in seen:
            seen.add((e[0], e[2]))
            out.append(e)
    return out


def slow_calls(loop: dict, slow_ms: float) -> list[dict]:
    """A closed loop's decode-only calls slower than slow_ms, with their trace rows, numbered as CallWatch
    numbers calls: the loop runs async, so the first call waits for no step and trace row i is call i + 1."""
    return [{"call": i + 1, "row": row} for i, row in enumerate(loop["steps"]["trace"])
            if row[0] >= slow_ms and not row[1]]


def long_events(prof, slow_ms: float) -> list[dict]:
    """The profiled run's events longer than slow_ms (runtime API calls and CPU ops), longest first."""
    out = []
    for e in prof.events():
        ms = e.cpu_time_total / 1e3 if e.device_type == torch.autograd.DeviceType.CPU else 0.0
        if ms >= slow_ms:
            out.append({"name": e.name, "ms": round(ms, 3), "start_ms": round(e.time_range.start / 1e3, 3)})
    return sorted(out, key=lambda r: -r["ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="as engine_step_bench's batches 64 256")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--slow-ms", type=float, default=2.5)
    ap.add_argument("--stall-ms", type=float, default=12.0,
                    help="dump the stacks of a launch (runner.execute) lasting longer, every this many ms")
    ap.add_argument("--out", type=Path, default=Path("closed_loop_stalls.json"))
    args = ap.parse_args()
    core, info = build_core(EngineConfig(model=args.model, device="cuda", dtype="bfloat16",
                                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192,
                                         gpu_memory_utilization=0.8))
    t0 = time.perf_counter()
    gc.collect()  # what a full collection over the start-up heap costs (the freeze below spares the loop it)
    full_collection_ms = (time.perf_counter() - t0) * 1e3
    heap_objects = freeze_startup_heap()
    probe = Probe(core)
    watch = CallWatch(core, args.stall_ms)
    core.async_scheduling = True
    loop = dict(concurrency=args.concurrency, num_requests=args.num_requests, prompt_len=args.prompt_len,
                output_len=args.output_len, probe=probe)
    mem0 = torch.cuda.memory_stats()
    warm = closed_loop(core, **loop)
    warm_events = watch.take()
    mem1 = torch.cuda.memory_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        # other prompts than the warm-up's (no prefix hits): the seed follows num_requests
        r = closed_loop(core, **{**loop, "num_requests": args.num_requests + 1})
    mem2 = torch.cuda.memory_stats()
    events_profiled = watch.take()
    slow, warm_slow = slow_calls(r, args.slow_ms), slow_calls(warm, args.slow_ms)
    allocator = {k: [mem1.get(k, 0) - mem0.get(k, 0), mem2.get(k, 0) - mem1.get(k, 0)]
                 for k in ALLOCATOR_COUNTS}
    events = long_events(prof, args.slow_ms)
    by_name = collections.Counter(e["name"] for e in events)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "warm_tok_s": warm["tok_s"], "profiled_tok_s": r["tok_s"],
                                    "slow_decode_calls": slow, "warm_slow_decode_calls": warm_slow,
                                    "allocator_warm_profiled": allocator,
                                    "warm_call_events": warm_events, "profiled_call_events": events_profiled,
                                    "full_collection_ms": full_collection_ms, "heap_objects": heap_objects,
                                    "long_events": events[:300]}, indent=1))
    print(f"warm-up loop {warm['tok_s']:.0f} tok/s, profiled loop {r['tok_s']:.0f} tok/s")
    print(f"a full collection over the start-up heap ({heap_objects} objects): {full_collection_ms:.1f} ms")
    print(f"caching allocator counts in the warm-up / profiled loop: {allocator}")
    for name, evs in (("warm-up loop", warm_events), ("profiled loop", events_profiled)):
        print(f"events inside calls (call, kind, detail, ms), {name}: "
              f"{[e for e in evs if e[1] != 'stalled_launch'][:30]}")
        for call, _, stack, ms in _distinct_stacks(evs):
            print(f"  stalled launch, call {call} ({ms} ms): {stack}")
    print("slow decode-only calls (wall ms, prompt, decodes, schedule, execute, wait), warm-up loop:")
    for s in warm_slow:
        print(f"  call {s['call']}: {s['row']}")
    print("the profiled loop:")
    for s in slow:
        print(f"  call {s['call']}: {s['row']}")
    print(f"events >= {args.slow_ms} ms by name (count): {dict(by_name.most_common(25))}")
    for e in events[:40]:
        print(f"  {e['ms']:9.3f} ms  {e['name'][:100]}")


if __name__ == "__main__":
    main()
