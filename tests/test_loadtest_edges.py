"""loadtest against servers that answer oddly, and flags that make no schedule (a review found each): a
malformed unary body fails its request, not the run; a TPOT SLO is never met unmeasured; E2EL ends at the
last token's event, as vLLM's latency; Ctrl-C stops the warm-up; bad arrival flags are usage errors before any
request; compare marks failures that appear from none."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from loadtest.benchmark import make_client, run_benchmark
from loadtest.cli import main
from loadtest.client import ClientConfig, RequestRecord
from loadtest.metrics import SLO, compute_metrics
from loadtest.mock_server import MockScript, MockServer, serve_in_thread
from loadtest.report import print_compare
from loadtest.workload import LengthRange, build_workload

REPO = Path(__file__).resolve().parents[1]


def run_against(app, n: int = 1, output_len: int = 4, stream: bool = True):
    specs = build_workload(n, LengthRange(8, 8), LengthRange(output_len, output_len), 0)
    with serve_in_thread(app) as url:
        cfg = ClientConfig(url, "mock", stream=stream, timeout_s=10.0, return_token_ids=False)

        async def go():
            async with make_client(1, 10.0) as client:
                return await run_benchmark(client, specs, cfg, 1, [0.0] * n)

        return asyncio.run(go())


async def start_response(receive, send, content_type: bytes) -> None:
    """Reads the request's body, then starts a 200 response of `content_type`."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})


def unary_app(body: dict):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await start_response(receive, send, b"application/json")
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
    return app


@pytest.mark.parametrize("body", [
    {"choices": [{"text": "abcd", "finish_reason": "length"}], "usage": [4]},
    {"choices": [{"text": "abcd"}], "usage": {"completion_tokens": "four"}},
    {"choices": {"0": {"text": "abcd"}}, "usage": {"completion_tokens": 4}},
    {"choices": 5, "usage": {"completion_tokens": 4}},
])
def test_a_malformed_unary_body_fails_its_request_not_the_run(body):
    result = run_against(unary_app(body), n=2, stream=False)
    assert [r.error_kind for r in result.records] == ["bad_response", "bad_response"]


def test_a_tpot_slo_is_not_met_by_a_request_it_never_measured():
    unary = RequestRecord(0, 8, 100, send_time=0.0, end_time=10.0, chunk_times=[10.0], output_tokens=100,
                          streamed=False)  # 100 tokens in 10 s, unstreamed: no TPOT
    assert compute_metrics([unary], 10.0, SLO(tpot_ms=1.0)).good_requests == 0
    one = RequestRecord(0, 8, 1, send_time=0.0, end_time=0.01, chunk_times=[0.01], output_tokens=1)
    assert compute_metrics([one], 0.01, SLO(tpot_ms=1.0)).good_requests == 1  # vLLM's 0 for one token
    with pytest.raises(SystemExit) as exc:  # and the CLI refuses to ask for one
        main(["--no-stream", "--slo-tpot-ms", "5", "--no-progress"])
    assert exc.value.code == 2


async def late_usage_app(scope, receive, send):
    """Four tokens 20 ms apart, then the usage block 0.4 s later (a proxy or a slow server's trailer)."""
    if scope["type"] != "http":
        return
    await start_response(receive, send, b"text/event-stream")

    async def event(payload) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True})

    for k in range(4):
        await asyncio.sleep(0.02)
        await event({"choices": [{"index": 0, "text": "x", "finish_reason": "length" if k == 3 else None}]})
    await asyncio.sleep(0.4)
    await event({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4}})
    await event(b"[DONE]")
    await send({"type": "http.response.body", "body": b""})


def test_e2el_and_tpot_end_at_the_last_tokens_event():
    (rec,) = run_against(late_usage_app).records
    assert rec.success and rec.output_tokens == 4
    assert rec.e2el == pytest.approx(rec.chunk_times[-1] - rec.send_time, abs=1e-9)
    assert rec.end_time - rec.send_time > rec.e2el + 0.3  # the run's duration still ends with the body
    assert rec.tpot < 0.1


def test_ctrl_c_during_the_warm_up_stops_before_anything_is_measured(tmp_path):
    server = MockServer(MockScript(0.05, 0.05))  # 20 tokens: ~1 s a request
    with serve_in_thread(server) as url:
        cmd = [sys.executable, "-m", "loadtest", "--base-url", url, "--input-len", "8", "--output-len", "20",
               "--num-requests", "4", "--concurrency", "1", "--warmup", "3", "--no-progress",
               "--out", str(tmp_path / "r.json")]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while server.requests_started < 1 and time.monotonic() < deadline:  # inside the first warm-up request
            time.sleep(0.02)
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    assert proc.returncode == 130 and "warm-up" in err
    assert elapsed < 5 and server.requests_started == 1, (elapsed, server.requests_started)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("flag,value", [("--request-rate", "0"), ("--request-rate", "-2"),
                                        ("--request-rate", "nan"), ("--burstiness", "0"),
                                        ("--burstiness", "nan")])
def test_bad_arrival_flags_are_usage_errors_before_any_request(flag, value):
    server = MockServer(MockScript(0.001, 0.001))
    with serve_in_thread(server) as url, pytest.raises(SystemExit) as exc:
        main(["--base-url", url, "--input-len", "8", "--output-len", "2", "--num-requests", "2",
              "--warmup", "2", "--no-progress", flag, value])
    assert exc.value.code == 2 and server.requests_started == 0


def test_compare_marks_failures_that_appear_from_none():
    def failed_line(a_failed: int, b_failed: int) -> str:
        a = {"completed": 10, "failed": a_failed, "duration_s": 2.0}
        b = {"completed": 10, "failed": b_failed, "duration_s": 2.0}
        console = Console(width=160, force_terminal=True, color_system="standard", record=True)
        print_compare(a, b, ("a", "b"), console)
        return next(x for x in console.export_text(styles=True).splitlines() if "failed" in x)

    assert "\x1b[32m" in failed_line(5, 0)  # fewer failures: green
    line = failed_line(0, 5)
    assert "\x1b[31m" in line and "from 0" in line  # new failures: red
