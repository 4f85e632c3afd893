"""A real `pagewalk serve` subprocess (uvicorn, the engine core in its own process) for server tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
GREEDY = {"temperature": 0, "ignore_eos": True}


def connect(server: Server, timeout: float = 10.0, rcvbuf: int | None = None) -> socket.socket:
    """A raw socket to `server`; `rcvbuf` set before connecting keeps the advertised window that small."""
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", server.port))
    s.settimeout(timeout)
    return s


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), "--device", "cpu",
               "--attention-backend", "torch", *args]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})})
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited early:\n{self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not healthy in {timeout}s:\n{self.log.read_text()}")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def metric(self, name: str, labels: dict | None = None) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                    return s.value
        raise KeyError(name)

    def wait_idle(self, timeout: float = 20) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0 and h["kv_cache"]["used_blocks"] == 0:
                return h
            time.sleep(0.05)
        raise AssertionError(f"server never went idle: {self.health()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def core_pid(self) -> int:
        """The engine-core process's pid, from the start-up log."""
        match = re.search(r"engine core process started \(pid (\d+)\)", self.log.read_text())
        assert match, self.log.read_text()
        return int(match.group(1))


# The seconds a server may take to exit once its hung core is killed: its processes' interpreters wind down
# (CPU-bound: the supervisor's alone ran 2.5 s with no system call between its last close and its exit,
# beside 3 busy processes on the 2-core box; the exit came 1.4-4.9 s after the kill there, ~0.3 s idle).
EXIT_AFTER_KILL_S = 10.0


def ended(pid: int) -> bool:
    """Process `pid` has ended (a zombie not yet reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_timed(proc: subprocess.Popen, pid: int, start: float,
               timeout: float = 60) -> tuple[int, float, float]:
    """Until `proc` exits (within `timeout` s of `start`, a time.monotonic()) -> (its exit code, the seconds
    from `start` until process `pid` ended (inf if it outlives `proc`), the seconds until `proc` exited)."""
    pid_ended = None
    while proc.poll() is None:
        if pid_ended is None and ended(pid):
            pid_ended = time.monotonic() - start
        assert time.monotonic() - start < timeout, f"not exited in {timeout} s"
        time.sleep(0.01)
    exited = time.monotonic() - start
    if pid_ended is None:
        pid_ended = exited if ended(pid) else float("inf")
    return proc.returncode, pid_ended, exited
