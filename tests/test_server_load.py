"""tools/server_load.py: per-process CPU from /proc over a window."""

import subprocess
import sys
import time

import pytest

from tools.server_load import CpuSampler, child_pids, cpu_seconds

SPIN = "import time\nt = time.time()\nwhile time.time() - t < 1.6:\n    pass\n"
PARENT = ("import subprocess, sys, time\n"
          f"c = subprocess.Popen([sys.executable, '-c', {SPIN!r}])\n"
          "c.wait()\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_sampler_sees_a_busy_child_and_an_idle_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        deadline = time.time() + 10
        while not child_pids(parent.pid) and time.time() < deadline:
            time.sleep(0.02)
        sampler = CpuSampler(parent.pid, interval=0.02)
        assert len(sampler.pids) == 2                                   # the parent and its one child
        sampler.start()
        t0 = time.perf_counter()
        time.sleep(0.9)
        sampler.stop()
        busy = sampler.busy(t0 + 0.1, t0 + 0.8)
        child = next(v for k, v in busy.items() if k != "api")
        assert child > 0.5, busy                                         # spinning: about one core
        assert busy["api"] < 0.2, busy                                   # waiting on the child
        assert sampler.busy(t0 + 5, t0 + 6) == {}                        # no samples in that window
    finally:
        parent.wait(timeout=10)
    assert cpu_seconds(parent.pid) is None                               # reaped: gone
