"""The load generator's own CPU use over the measured window, so a report says whether the client kept up.

Every process that drives requests records user+system CPU seconds (`time.process_time()`, all its
threads) and wall seconds from the common start to its last completion; in a multi-process run the parent,
which only merges records and draws the progress bar, records its own as well. The report carries:
- `client_processes`: processes that drove requests;
- `client_cpu_s`: CPU seconds of all of them plus the parent's;
- `client_cpu_util`: client_cpu_s / (window wall seconds x client_processes), the window being the
  longest driver's;
- `client_busy_max`: the busiest single process, CPU / wall. An asyncio process near 100% cannot read its
  streams as they arrive, so above BUSY_WARNING the printed report warns that the generator may be the
  bottleneck (and its token timestamps late): use more `--processes`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

BUSY_WARNING = 0.85


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (CLOCK_PROCESS_CPUTIME_ID: no tick rounding)."""
    return time.process_time()


@dataclass(frozen=True)
class ProcessLoad:
    role: str  # "driver" (sent requests) | "parent" (merged the drivers' records)
    cpu_s: float
    wall_s: float

    @property
    def busy(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class LoadMeter:
    """This process's CPU and wall clock from `start` (a perf_counter time, maybe ahead) to stop()."""

    def __init__(self, role: str, start: float | None = None) -> None:
        self.role = role
        self.start = time.perf_counter() if start is None else start
        self.cpu0 = cpu_seconds()

    def stop(self) -> ProcessLoad:
        return ProcessLoad(self.role, cpu_seconds() - self.cpu0, max(time.perf_counter() - self.start, 0.0))


def load_fields(loads: list[ProcessLoad]) -> dict:
    """The report's client_* fields; empty when nothing was recorded."""
    drivers = [x for x in loads if x.role == "driver"]
    if not drivers:
        return {}
    wall = max(x.wall_s for x in drivers)  # the window: the common start to the last driver's end
    cpu = sum(x.cpu_s for x in loads)
    return {
        "client_processes": len(drivers),
        "client_cpu_s": cpu,
        # over every process measured (the parent's CPU is in the sum: over the drivers alone it read > 1)
        "client_cpu_util": cpu / (wall * len(loads)) if wall > 0 else 0.0,
        # the drivers': what more --processes relieves (the parent merges their records whatever the count)
        "client_busy_max": max(x.busy for x in drivers),
    }


def busy_warning(report: dict) -> str | None:
    busy = report.get("client_busy_max")
    if busy is None or busy <= BUSY_WARNING:
        return None
    return (f"load generator: a process was {busy:.0%} busy (> {BUSY_WARNING:.0%}), it may be the "
            f"bottleneck: use more --processes (now {report['client_processes']})")  # fmt: skip
