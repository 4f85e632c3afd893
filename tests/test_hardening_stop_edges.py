"""Stopping at the edges (a review found each): a hung core with nothing in flight is killed within the
shutdown's bound (it ignores SIGTERM, so waiting for a terminate() was lost time); Ctrl-C while the core
starts exits at once; SIGTERM while it starts is a clean stop (no process or directory left behind); a
second Ctrl-C during the drain leaves no traceback."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_helpers import EXIT_AFTER_KILL_S, REPO, Server, free_port, wait_timed

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("servers", ["1", "2"])
def test_an_idle_hung_core_is_killed_within_the_shutdown_bound(tmp_path, servers):
    """The core is killed within --shutdown-timeout + 8 s of the SIGTERM (15 s before: 10 s waiting, 5 s
    terminating; 5.1-5.7 s now), and the server then exits 1 within EXIT_AFTER_KILL_S: the README's bound
    on the exit itself, 9 s, was missed beside 3 busy processes with two API servers (9.5 and 10.4 s, the
    kill at ~5.5), as the supervisor's interpreter wound down."""
    srv = Server(tmp_path, "--api-server-count", servers, "--num-blocks", "256", "--shutdown-timeout", "1")
    core = srv.core_pid()
    try:
        os.kill(core, signal.SIGSTOP)  # hung, and no request in flight: no abort goes unanswered
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code, killed, exited = wait_timed(srv.proc, core, start)
        assert code == 1, srv.log.read_text()[-2000:]  # killed: a failure a supervisor sees
        assert killed < 1 + 8, (killed, exited, srv.log.read_text()[-2000:])
        assert exited - killed < EXIT_AFTER_KILL_S, (killed, exited, srv.log.read_text()[-2000:])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
        srv.stop()


def starting(tmp_path):
    """A server whose core process has started and is still loading; its temp files in a folder of its own."""
    port = free_port()
    log = tmp_path / "server.log"
    private = tmp_path / "tmp"
    private.mkdir()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--device", "cpu",
           "--attention-backend", "torch", "--num-blocks", "256"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(private)})
    deadline = time.monotonic() + 60
    while not (m := re.search(r"engine core process started \(pid (\d+)\)", log.read_text())):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.005)
    return proc, log, int(m.group(1)), private


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("sig,code,line", [(signal.SIGINT, 130, "interrupted during start-up"),
                                           (signal.SIGTERM, 0, "stopped during start-up")])
def test_a_signal_while_the_core_starts_stops_at_once_and_leaves_nothing(tmp_path, sig, code, line):
    proc, log, core, private = starting(tmp_path)
    try:
        proc.send_signal(sig)
        start = time.monotonic()
        assert proc.wait(timeout=60) == code, log.read_text()[-2000:]
        assert time.monotonic() - start < 5 and line in log.read_text()  # 10.5 s, or death by SIGTERM
        deadline = time.monotonic() + 10
        while not gone(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(core)
        assert not glob.glob(str(private / "pagewalk-core-*"))
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig,code,line", [(signal.SIGINT, 130, "interrupted during start-up"),
                                           (signal.SIGTERM, 0, "stopped during start-up")])
def test_a_signal_while_torch_loads_stops_cleanly(sig, code, line):
    """The handler was set after the flags' parsing and torch's import (~3 s): a SIGTERM then ended the
    process by default (-15), a Ctrl-C printed a traceback (a review). 1 s in, torch is still loading."""
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--device", "cpu", "--port",
                             str(free_port())], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(1.0)
    proc.send_signal(sig)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == code and line in out and "Traceback" not in out, (proc.returncode, out[-1500:])


def test_a_second_ctrl_c_during_the_drain_leaves_no_traceback(tmp_path):
    srv = Server(tmp_path, "--num-blocks", "256", "--shutdown-timeout", "20")
    events, started = [], threading.Event()

    def reader() -> None:
        body = {"prompt": "x", "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        assert started.wait(30)
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)  # draining: the stream goes on
        srv.proc.send_signal(signal.SIGINT)  # uvicorn's force exit: it skips the lifespan's shutdown
        assert srv.proc.wait(timeout=60) == 0
        thread.join(10)
        assert events[-1] == "[DONE]"  # the drain finished the stream
        log = srv.log.read_text()
        assert "Traceback" not in log and "CancelledError" not in log, log[-2500:]
    finally:
        srv.stop()


def spawned_children(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing's spawn started (the core, the API servers)."""
    kids = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError), open(task) as f:
            kids += [int(c) for c in f.read().split()]
    spawned = []
    for kid in kids:
        with contextlib.suppress(OSError), open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                spawned.append(kid)
    return spawned


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_supervisor_spawns_api_servers_stops_them_and_the_core(tmp_path, sig):
    """Past the core's start-up the supervisor spawns its API servers (~15 ms each: 24 here); a signal then
    stops those started and the core, with no traceback (it hung in Python's exit, waiting for the core)."""
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", "0", "--device", "cpu",
           "--attention-backend", "torch", "--num-blocks", "64", "--api-server-count", "24"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while len(kids := spawned_children(proc.pid)) < 2:  # the core, then the first API server
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.005)
        core = min(kids)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not gone(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(core) and "Traceback" not in log.read_text(), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def run_patched_main(patch: str, args: list[str], timeout: float) -> tuple[int | None, str, list[int]]:
    """`patch` (Python source) then cli.main(args) in a fresh interpreter -> (exit code, or None if it hung;
    its output; its children still alive, which are then killed)."""
    code = f"import sys\n{patch}\nfrom server.cli import main\nsys.exit(main({args!r}))\n"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    alive = [kid for kid in spawned_children(proc.pid) if not gone(kid)] if rc is None else []
    for pid in alive + ([proc.pid] if proc.poll() is None else []):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    return rc, proc.stdout.read(), alive


SERVE_ARGS = ["serve", "--port", "0", "--device", "cpu", "--attention-backend", "torch", "--num-blocks", "64"]


def test_a_sigterm_before_uvicorns_handlers_still_stops_the_server():
    """Between the server's build and uvicorn's own handlers a SIGTERM was swallowed (no-op handlers) and the
    server served on; a supervisor, which signals each server once, then waited for it without end."""
    patch = ("import os, signal, uvicorn\norig = uvicorn.Server.__init__\n"
             "def init(self, config):\n    orig(self, config)\n    os.kill(os.getpid(), signal.SIGTERM)\n"
             "uvicorn.Server.__init__ = init")
    rc, out, _ = run_patched_main(patch, SERVE_ARGS, timeout=60)
    assert rc == 0 and "Traceback" not in out, out[-2000:]


def test_a_server_that_cannot_be_spawned_stops_the_others_and_the_core():
    """An error starting an API server (EAGAIN, out of memory) left those started and the core running, and
    the exit waited for them without end."""
    patch = ("import multiprocessing.context as mc\nreal = mc.SpawnProcess.start\ncalls = []\n"
             "def start(self):\n    calls.append(self.name)\n    if len(calls) == 3:\n"
             "        raise OSError(11, 'Resource temporarily unavailable')\n    return real(self)\n"
             "mc.SpawnProcess.start = start")
    rc, out, alive = run_patched_main(patch, SERVE_ARGS + ["--api-server-count", "3"], timeout=90)
    assert rc == 1 and not alive and "Resource temporarily unavailable" in out, (rc, alive, out[-2000:])


def test_stops_are_held_while_the_modules_load_and_raised_at_release():
    """What makes the case above safe: a SIGTERM or SIGINT during the imports is noted, not raised inside a
    C extension's import; release() raises the first noted (SIGTERM: Terminated), restore() puts back the
    handlers it found."""
    from server.cli import HeldStops, Terminated

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    held = HeldStops()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # (handlers run between bytecodes: nothing raised here)
        assert held.noted == signal.SIGTERM
        with pytest.raises(Terminated):
            held.release()
    finally:
        held.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
