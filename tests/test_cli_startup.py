"""`pagewalk serve` start-up under a user's mistakes and signals: a port in use, Ctrl-C or SIGTERM while the
model loads, an IPv6 host, --port 0 with several API servers, --served-model-name before MODEL (review)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.cli import parse_serve_args

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[1]


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--device", "cpu",
                                 "--attention-backend", "torch", *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 90) -> re.Match | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if m := re.search(pattern, log.read_text()):
            return m
        time.sleep(0.1)
    return re.search(pattern, log.read_text())


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("servers", ["1", "2"])  # (with 2 the supervisor built the core first: a review)
def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path, servers):
    taken = socket.create_server(("127.0.0.1", 0))
    proc, log = start(tmp_path, "tiny", "--port", str(taken.getsockname()[1]), "--api-server-count", servers)
    try:
        code = proc.wait(timeout=90)
    finally:
        kill(proc)
        taken.close()
    text = log.read_text()
    assert code == 1 and "Traceback" not in text and "address already in use" in text.lower(), text[-2000:]
    assert "engine core process started" not in text  # refused before anything was built


@pytest.mark.parametrize("servers", ["1", "2"])
def test_ctrl_c_while_the_model_loads_is_one_line(tmp_path, servers):
    proc, log = start(tmp_path, "tiny", "--port", "0", "--api-server-count", servers)
    try:
        assert wait_for(log, r"engine core process started", proc), log.read_text()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        kill(proc)
    text = log.read_text()
    assert "Traceback" not in text and code in (1, 130), (code, text[-3000:])


def test_a_core_whose_parent_dies_during_start_up_exits(tmp_path):
    proc, log = start(tmp_path, "tiny", "--port", "0")
    core = None
    try:
        m = wait_for(log, r"engine core process started \(pid (\d+)\)", proc)
        assert m, log.read_text()
        core = int(m.group(1))
        proc.send_signal(signal.SIGTERM)  # before the handlers are set: the parent dies of it
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(core):
            time.sleep(0.2)
        assert not _alive(core), "the engine core outlived the process that started it"
    finally:
        kill(proc)
        if core is not None and _alive(core):
            os.kill(core, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("extra, pattern", [
    (["--host", "::1"], r"url=http://\[::1\]:(\d+)"),
    (["--api-server-count", "2"], r"API servers \(pids [^)]*\) on http://127\.0\.0\.1:(\d+),"),
])  # fmt: skip
def test_the_start_up_line_names_a_url_a_client_can_use(tmp_path, extra, pattern):
    proc, log = start(tmp_path, "tiny", "--port", "0", *extra)
    try:
        m = wait_for(log, pattern, proc)
    finally:
        kill(proc)
    assert m and int(m.group(1)) > 0, log.read_text()[-2000:]


def test_served_model_name_before_model_is_a_usage_error(tmp_path, capsys):
    # nargs="+" took the checkpoint for a second name, and the tiny preset was served under the user's name
    with pytest.raises(SystemExit) as e:
        parse_serve_args(["serve", "--served-model-name", "my-model", str(tmp_path)])
    assert e.value.code == 2 and "looks like MODEL" in capsys.readouterr().err
    args = parse_serve_args(["serve", str(tmp_path), "--served-model-name", "my-model"])
    assert args.model == str(tmp_path) and args.served_model_name == ["my-model"]


def test_a_stop_while_the_server_is_built_around_a_running_core_stops_the_core(monkeypatch, caplog, capsys):
    """The core runs before uvicorn's handlers are set: a SIGTERM (cli's Terminated) there ends start-up
    cleanly and takes the core with it (Python's exit would wait for a core that ignores SIGTERM)."""
    import logging

    import server.api.app as app_module
    from server.cli import Terminated, main

    def interrupted(*args, **kwargs):
        raise Terminated

    monkeypatch.setattr(app_module, "create_app", interrupted)
    with caplog.at_level(logging.INFO):
        assert main(["serve", "--port", "0", "--device", "cpu", "--attention-backend", "torch",
                     "--num-blocks", "64"]) == 0
    assert "stopped during start-up" in capsys.readouterr().err
    (pid,) = [int(m) for m in re.findall(r"engine core process started \(pid (\d+)\)", caplog.text)]
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            break
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
