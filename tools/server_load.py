"""What a served run costs the server's processes, for tools/serving_bench (Linux only, not a test).

`CpuSampler` reads the CPU time (user + system, all threads) of the API process and of each of its child
processes (the engine core) from /proc every `interval` seconds while a load test runs; `busy(t0, t1)`
gives each process's share of one core over the load test's measured window (its first send to its last
completion, perf_counter times: CLOCK_MONOTONIC, one clock for every process). A process near 100% of a
core is what bounds the run.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK       # utime, stime (fields 14 and 15 of stat)


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (a scan of /proc: no procfs children file needed)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


class CpuSampler(threading.Thread):
    """Samples (perf_counter, {name: CPU seconds}) for the API process ("api") and each child ("child
    <pid>") until stop()."""

    def __init__(self, api_pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.pids = {"api": api_pid, **{f"child {p}": p for p in child_pids(api_pid)}}
        self.interval = interval
        self.times: list[float] = []
        self.samples: list[dict[str, float | None]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.times.append(time.perf_counter())
            self.samples.append({name: cpu_seconds(pid) for name, pid in self.pids.items()})
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def busy(self, t0: float, t1: float) -> dict[str, float]:
        """Each process's CPU seconds over [t0, t1] (the nearest samples inside it) / the seconds between
        those samples: 1.0 is one core busy the whole window. Empty if fewer than two samples fall in it."""
        i, j = bisect.bisect_left(self.times, t0), bisect.bisect_right(self.times, t1) - 1
        if j <= i:
            return {}
        span = self.times[j] - self.times[i]
        a, b = self.samples[i], self.samples[j]
        return {name: (b[name] - a[name]) / span for name in self.pids
                if a[name] is not None and b[name] is not None}
