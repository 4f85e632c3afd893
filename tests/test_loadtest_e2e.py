"""loadtest end to end against the real pagewalk server (tiny model, CPU) started with `pagewalk serve`."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

try:  # skipped only while the server package is still being written
    import server.api.app  # noqa: F401
    import server.cli  # noqa: F401
except ModuleNotFoundError as e:
    if not (e.name or "").startswith("server"):
        raise
    pytest.skip(f"pagewalk server not built yet ({e.name} missing)", allow_module_level=True)

from loadtest.cli import main
from loadtest.mock_server import free_port

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[1]
N, C, INPUT_LEN, OUTPUT_LEN = 8, 4, 16, 8


@pytest.fixture(scope="module")
def pagewalk_url(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())", "serve",
           "--model", "tiny", "--device", "cpu", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"pagewalk serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"pagewalk serve did not become healthy:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_loadtest(url, out, *extra):
    argv = ["--base-url", url, "--num-requests", str(N), "--concurrency", str(C),
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--no-progress",
            "--out", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads(Path(out).read_text())


def test_completions_end_to_end(pagewalk_url, tmp_path):
    r = run_loadtest(pagewalk_url, tmp_path / "c.json", "--save-detailed")
    assert (r["completed"], r["failed"], r["errors"]) == (N, 0, {})
    assert r["total_output_tokens"] == N * OUTPUT_LEN
    assert r["total_input_tokens"] == N * INPUT_LEN  # token-id prompts of exactly --input-len
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"], rel=1e-12)
    assert r["request_throughput"] == pytest.approx(N / r["duration_s"], rel=1e-12)
    # one ITL per gap between a request's content chunks: OUTPUT_LEN - 1 gaps when every token streams as
    # its own chunk, fewer when the server, behind, merges tokens that arrived meanwhile into one chunk
    chunks = [len(row["chunk_times_s"]) for row in r["requests"]]
    assert all(1 <= c <= OUTPUT_LEN for c in chunks)
    assert r["itl_ms"]["count"] == sum(c - 1 for c in chunks) and r["tpot_ms"]["count"] == N
    assert 0 < r["ttft_ms"]["p50"] <= r["e2el_ms"]["p50"]
    assert r["server_health"]["status"] == "ok" and r["server_health"]["model"] == "tiny"
    assert r["config"]["model"] == "tiny"
    # the server's steps in the window: every prompt token and every token after each request's first (CPU:
    # no async overlap); the metrics of a step are recorded just after its tokens go out, so the last step of
    # the warm-up or of the run (a decode step of at most C rows) may fall on either side of a reading
    ran = r["server_steps"] * r["server_tokens_per_step"]
    assert abs(ran - N * (INPUT_LEN + OUTPUT_LEN - 1)) <= C
    assert 1 <= r["server_prompt_steps"] <= N and r["server_steps"] >= OUTPUT_LEN
    assert 0 < r["server_handoff_ms"] < r["ttft_ms"]["max"]  # the run's requests' mean handoff to the core


def test_chat_end_to_end_calibrates_prompt_length(pagewalk_url, tmp_path):
    r = run_loadtest(pagewalk_url, tmp_path / "chat.json", "--endpoint", "chat", "--input-len", "48")
    assert (r["completed"], r["failed"]) == (N, 0)
    assert r["total_input_tokens"] == N * 48  # chat template tokens measured and subtracted
    assert r["total_output_tokens"] == N * OUTPUT_LEN


def test_two_processes_end_to_end(pagewalk_url, tmp_path):
    r = run_loadtest(pagewalk_url, tmp_path / "p2.json", "--processes", "2")
    assert (r["completed"], r["failed"]) == (N, 0)
    assert r["total_output_tokens"] == N * OUTPUT_LEN  # chunks may carry several tokens when the server lags
    assert r["client_processes"] == 2 and 0 < r["client_cpu_util"] <= 1.05


def test_a_rerun_of_the_same_prompts_reports_the_servers_prefix_cache_hits(pagewalk_url, tmp_path):
    # 48-token prompts are 3 blocks of 16; a replay finds the first two cached (the last token is computed)
    args = ("--input-len", "48", "--seed", "4242")
    fresh = run_loadtest(pagewalk_url, tmp_path / "fresh.json", *args)
    replay = run_loadtest(pagewalk_url, tmp_path / "replay.json", *args)
    assert fresh["server_prefix_cache_hit_rate"] < 0.1
    assert replay["server_prefix_cache_hit_rate"] == pytest.approx(32 / 48, abs=0.02)
