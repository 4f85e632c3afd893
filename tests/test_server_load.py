"""tools/server_load.py: per-process CPU from /proc over a window."""

import subprocess
import sys
import time

import pytest

from tools.server_load import CpuSampler, child_pids, cpu_seconds

SPIN = "import time\nt = time.time()\nwhile time.time() - t < 2.5:\n    pass\n"  # past the window
PARENT = ("import subprocess, sys, time\n"
          f"c = subprocess.Popen([sys.executable, '-c', {SPIN!r}])\n"
          "c.wait()\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_sampler_sees_a_busy_child_and_an_idle_parent():
    """The sampler's share of a core for a spinning child is the child's CPU seconds over the window, read
    here from /proc, within 0.05 (10 ms ticks; its samples up to 20 ms inside the window's ends: 0.017 at
    most in 11 runs), and the waiting parent's is near 0. The child spins on a whole core only on an idle
    box: beside 3 busy processes it got 0.13-0.26 of one, and `child > 0.5` failed 6 runs of 6."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        deadline = time.time() + 10
        while not (kids := child_pids(parent.pid)) and time.time() < deadline:
            time.sleep(0.02)
        sampler = CpuSampler(parent.pid, interval=0.02)
        assert len(sampler.pids) == 2                                   # the parent and its one child
        sampler.start()
        t0 = time.perf_counter()
        time.sleep(0.1)
        start = (time.perf_counter(), cpu_seconds(kids[0]))
        time.sleep(0.7)
        end = (time.perf_counter(), cpu_seconds(kids[0]))
        time.sleep(0.1)
        sampler.stop()
        assert start[1] is not None and end[1] is not None               # spinning all along
        spun = (end[1] - start[1]) / (end[0] - start[0])                # the child's share, read apart
        busy = sampler.busy(start[0], end[0])
        child = next(v for k, v in busy.items() if k != "api")
        assert spun > 0.05 and child == pytest.approx(spun, abs=0.05), (busy, spun)  # spinning
        assert busy["api"] < min(0.2, child / 2), busy                  # waiting on the child
        assert sampler.busy(t0 + 5, t0 + 6) == {}                        # no samples in that window
    finally:
        parent.wait(timeout=10)
    assert cpu_seconds(parent.pid) is None                               # reaped: gone
