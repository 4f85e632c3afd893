"""loadtest client + driver against a scripted SSE server (real uvicorn) with known token timing.

The mock sends token k at 100 ms + k * 40 ms after reading the request. On a loaded 2-core CI machine the
client and the server (one process) are late by tens of ms (TTFT and E2EL p50 20-57 ms over, the duration
of two waves 41-111, beside 3 busy processes), so the timing bounds are one-sided where sleeps can only
overshoot, and NOISE_MS is 100: the script's times are twice what they were (50 + k * 20 ms against a
NOISE_MS of 30, which failed 3 runs of 6 there), so that its errors stay far apart from the wrong readings
(a TTFT read at the last token: 380 ms; from the run's start: a p50 of 290).
"""

import asyncio
import gc
import json
from dataclasses import replace

import pytest

from loadtest.benchmark import drive, make_client, open_clients, run_benchmark
from loadtest.client import ClientConfig, RequestRecord, calibrate_chat
from loadtest.metrics import compute_metrics
from loadtest.mock_server import MockScript, MockServer, free_port, serve_in_thread
from loadtest.workload import ChatCalibration, LengthRange, arrival_offsets, build_workload

pytestmark = pytest.mark.timeout(60)

FIRST_MS, GAP_MS, NOISE_MS = 100.0, 40.0, 100.0


def run(base_url, n, concurrency, output_len=8, endpoint="completions", stream=True, stop_after=None,
        chat=ChatCalibration(), input_len=12, rate=float("inf")):  # fmt: skip
    specs = build_workload(n, LengthRange(input_len, input_len), LengthRange(output_len, output_len), 0,
                           endpoint, chat=chat)  # fmt: skip
    cfg = ClientConfig(base_url, "mock", endpoint, stream, timeout_s=10.0)

    async def go():
        stop = asyncio.Event()
        if stop_after is not None:
            asyncio.get_running_loop().call_later(stop_after, stop.set)
        offsets = arrival_offsets(n, rate, 1.0, 0)
        async with make_client(concurrency, 10.0) as client:
            return await run_benchmark(client, specs, cfg, concurrency, offsets, stop)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def timed_server():
    with serve_in_thread(MockServer(MockScript(FIRST_MS / 1000, GAP_MS / 1000))) as url:
        yield url


def test_timing_metrics_match_the_script(timed_server):
    """The client's arithmetic against a script's known timing, within NOISE_MS: the scripted server runs in
    this process, so the collector runs first and not during the run (once in a full run on CI's 2 cores
    the TTFT p50 read 258 ms; a full collection over a worker's heap after 120 tests took 163 ms, ~400K
    objects tracked). A run before it warms the client's and the server's first-use paths (a process's first
    run took 230-260 ms longer over two waves beside 3 busy processes)."""
    n, out_len = 6, 8
    run(timed_server, 3, concurrency=3, output_len=2)  # warm-up, not measured
    gc.collect()
    gc.disable()
    try:
        result = run(timed_server, n, concurrency=3, output_len=out_len)
    finally:
        gc.enable()
    m = compute_metrics(result.records, result.duration_s)
    assert (m.completed, m.failed, result.interrupted) == (n, 0, False)
    assert m.total_output_tokens == n * out_len and m.total_input_tokens == n * 12
    assert FIRST_MS <= m.ttft_ms.p50 <= FIRST_MS + NOISE_MS
    assert m.itl_ms.count == n * (out_len - 1)
    assert GAP_MS - 6 <= m.itl_ms.mean <= GAP_MS + 6  # per request: (last - first chunk) / 7, anchored
    assert GAP_MS - 10 <= m.itl_ms.p50 <= GAP_MS + 10
    assert GAP_MS - 6 <= m.tpot_ms.mean <= GAP_MS + 6
    expected_e2el = FIRST_MS + (out_len - 1) * GAP_MS
    assert expected_e2el <= m.e2el_ms.p50 <= expected_e2el + NOISE_MS
    # two waves of 3 at concurrency 3: the duration covers both
    assert 2 * expected_e2el <= result.duration_s * 1000 <= 2 * expected_e2el + 3 * NOISE_MS
    # the throughput arithmetic is exact
    assert m.duration_s == max(r.end_time for r in result.records) - min(r.send_time for r in result.records)
    assert m.output_throughput == m.total_output_tokens / m.duration_s
    assert m.request_throughput == n / m.duration_s
    for rec in result.records:
        assert rec.tpot == pytest.approx((rec.e2el - rec.ttft) / (out_len - 1))
        assert len(rec.chunk_times) == out_len


def test_concurrency_limits_requests_in_flight(timed_server):
    result = run(timed_server, 4, concurrency=1, output_len=3)
    spans = sorted((r.send_time, r.end_time) for r in result.records)
    assert all(prev_end <= start for (_, prev_end), (start, _) in zip(spans, spans[1:], strict=False))


def test_poisson_arrivals_spread_the_sends(timed_server):
    """The sends follow the arrival offsets within 0.1 s, at 8 requests/s (0, 0.13, 0.17, 0.84, 0.89 s: all
    at once is 0.89 s off at the last, evenly spaced 0.47 s at the fourth). The event loop sends late while
    it reads the streams before: up to 31 ms beside 3 busy processes, 154 ms in a process's first run
    (warmed up here; under xdist this test may be its worker's first), against 0.04 s at 20 requests/s."""
    run(timed_server, 2, concurrency=2, output_len=2)  # warm-up, not measured
    result = run(timed_server, 5, concurrency=5, output_len=2, rate=8.0)
    sends = sorted(r.send_time - result.start_time for r in result.records)
    expected = arrival_offsets(5, 8.0, 1.0, 0)
    assert sends == pytest.approx(expected, abs=0.1)


def test_no_stream_has_ttft_equal_to_e2el_and_no_itl(timed_server):
    result = run(timed_server, 3, concurrency=3, output_len=5, stream=False)
    m = compute_metrics(result.records, result.duration_s)
    assert m.completed == 3 and m.total_output_tokens == 15
    assert m.itl_ms is None and m.tpot_ms is None
    assert m.ttft_ms.mean == pytest.approx(m.e2el_ms.mean, abs=1.0)
    assert m.e2el_ms.p50 >= FIRST_MS + 4 * GAP_MS


def test_chat_calibration_gives_exact_prompt_length(timed_server):
    cfg = ClientConfig(timed_server, "mock", "chat")

    async def calibrate():
        async with make_client(1, 10.0) as client:
            return await calibrate_chat(client, cfg)

    chat = asyncio.run(calibrate())
    assert chat == ChatCalibration(MockScript().chat_template_tokens, 1.0)
    result = run(timed_server, 3, 3, output_len=4, endpoint="chat", chat=chat, input_len=30)
    assert [r.input_len for r in result.records] == [30, 30, 30]  # from the server's usage
    assert all(len(r.chunk_times) == 4 and r.output_tokens == 4 for r in result.records)


def test_failures_are_counted_by_kind():
    script = MockScript(0.005, 0.002, behaviours=("ok", "429", "500", "drop", "no_done", "error", "abort"))
    with serve_in_thread(MockServer(script)) as url:
        result = run(url, 14, concurrency=1, output_len=4)
    m = compute_metrics(result.records, result.duration_s)
    assert (m.completed, m.failed) == (2, 12)
    assert m.errors == {"http_429": 2, "http_500": 2, "incomplete_stream": 2, "stream_dropped": 2,
                        "stream_error": 2, "finish_abort": 2}  # fmt: skip
    assert m.total_output_tokens == 8  # failed requests' tokens are not counted
    assert {r.error for r in result.records if r.error_kind == "http_429"} == {
        '{"error": {"message": "scripted 429", "type": "server_error", "param": null, "code": null}}'
    }


@pytest.mark.parametrize("body", [b"\xff\xfe not utf-8", b"[1, 2]", b"{not json"])
def test_a_200_that_is_no_json_object_is_a_bad_response(body):
    """A unary 200 whose body is not UTF-8 JSON (a proxy's page, a broken server) fails that request; it
    crashed the whole run."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    with serve_in_thread(app) as url:
        result = run(url, 2, concurrency=1, stream=False)
    assert [r.error_kind for r in result.records] == ["bad_response", "bad_response"]


def scripted(events: list[bytes] | None = None, body: bytes | None = None):
    """An ASGI app that answers every request with these SSE events (or this JSON body)."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        kind = b"text/event-stream" if events is not None else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        for e in events or []:
            await send({"type": "http.response.body", "body": b"data: " + e + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": body or b""})
    return app


def test_a_stream_without_a_content_chunk_fails():
    # it has no TTFT, yet its usage tokens counted in the throughput (vLLM's bench fails it too)
    empty = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
    events = [json.dumps(empty).encode(),
              json.dumps({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2}}).encode(),
              b"[DONE]"]
    specs = build_workload(1, LengthRange(12, 12), LengthRange(2, 2), 0)
    cfg = ClientConfig("", "mock", return_token_ids=False, timeout_s=10.0)

    async def go(url):
        async with make_client(1, 10.0) as client:
            return await run_benchmark(client, specs, replace(cfg, base_url=url), 1, [0.0])

    with serve_in_thread(scripted(events)) as url:
        result = asyncio.run(go(url))
    assert [r.error_kind for r in result.records] == ["no_content"]


@pytest.mark.parametrize("choice, usage, kind, tokens", [
    ({"text": "abcd", "finish_reason": "length"}, None, "no_usage", 0),  # 0 tokens would read as a success
    ({"text": "abcd", "finish_reason": "length", "token_ids": [1, 2, 3, 4]}, None, None, 4),
    ({"text": "abcd", "finish_reason": "length"}, {"prompt_tokens": 12, "completion_tokens": 5}, None, 5),
])  # fmt: skip
def test_a_unary_response_counts_usage_then_token_ids(choice, usage, kind, tokens):
    body = json.dumps({"choices": [{"index": 0, **choice}], **({"usage": usage} if usage else {})}).encode()
    with serve_in_thread(scripted(body=body)) as url:
        result = run(url, 1, concurrency=1, stream=False)
    (rec,) = result.records
    assert rec.error_kind == kind and (rec.output_tokens if kind is None else 0) == tokens


def test_unreachable_server_fails_every_request_without_raising():
    result = run(f"http://127.0.0.1:{free_port()}", 3, concurrency=2)
    m = compute_metrics(result.records, result.duration_s)
    assert (m.completed, m.failed, m.errors) == (0, 3, {"connect_error": 3})


def test_stop_returns_the_finished_requests():
    with serve_in_thread(MockServer(MockScript(0.05, 0.05))) as url:  # 20 tokens: ~1.0 s per request
        result = run(url, 6, concurrency=2, output_len=20, stop_after=1.5)
    assert result.interrupted
    assert len(result.records) == 2 and all(r.success for r in result.records)
    assert compute_metrics(result.records, result.duration_s).total_output_tokens == 40


@pytest.mark.parametrize("return_ids, send_usage, chunks, tokens", [
    (True, True, 8, 8),  # every token arrives as a chunk with token_ids, even the ones without text yet
    (True, False, 8, 8),  # no usage: counted from the streamed token ids
    (False, True, 4, 8),  # text-only chunks (vLLM's rule): half the tokens show no text; usage has the count
    (False, False, 4, None),  # 8 tokens in 4 chunks: counting chunks would say 4, so the request fails
])  # fmt: skip
def test_chunks_without_text_still_count_with_token_ids(return_ids, send_usage, chunks, tokens):
    script = MockScript(0.005, 0.005, send_usage=send_usage, text_every=2)
    specs = build_workload(2, LengthRange(4, 4), LengthRange(8, 8), 0)
    cfg = ClientConfig("", "mock", return_token_ids=return_ids, timeout_s=10.0)

    async def go(url):
        async with make_client(2, 10.0) as client:
            return await run_benchmark(client, specs, replace(cfg, base_url=url), 2, [0.0, 0.0])

    with serve_in_thread(MockServer(script)) as url:
        result = asyncio.run(go(url))
    assert [len(r.chunk_times) for r in result.records] == [chunks, chunks]
    if tokens is None:
        assert [r.error_kind for r in result.records] == ["no_usage", "no_usage"]
        return
    assert all(r.success for r in result.records)
    assert [r.output_tokens for r in result.records] == [tokens, tokens]


def test_slots_share_small_connection_pools(timed_server):
    async def pools():
        async with open_clients(40, 10.0) as clients:
            return [c._transport._pool._max_connections for c in clients]

    assert asyncio.run(pools()) == [14, 13, 13]  # POOL_CONNECTIONS = 16 at most, slots dealt round-robin
    specs = build_workload(40, LengthRange(4, 4), LengthRange(3, 3), 0)
    cfg = ClientConfig(timed_server, "mock", timeout_s=10.0)
    result = asyncio.run(drive(specs, cfg, 20, [0.0] * 40))
    assert len(result.records) == 40 and all(r.success for r in result.records)
    edges = sorted([(r.send_time, 1) for r in result.records] + [(r.end_time, -1) for r in result.records])
    in_flight = [sum(step for _, step in edges[: i + 1]) for i in range(len(edges))]
    assert max(in_flight) == 20  # the whole concurrency is used, across both clients, and never exceeded


def test_payload_carries_the_sampling_settings():
    from loadtest.client import ClientConfig, build_payload
    from loadtest.workload import RequestSpec
    spec = RequestSpec(index=0, prompt=[5, 6], input_len=2, output_len=4)
    payload = build_payload(spec, ClientConfig(base_url="http://x", model="m", temperature=0.8, top_p=0.95))
    assert payload["temperature"] == 0.8 and payload["top_p"] == 0.95 and payload["max_tokens"] == 4


def test_one_slot_raising_stops_every_slot(monkeypatch):
    """An exception out of one slot (not an httpx.HTTPError: a bug, or a worker's broken pipe) ends the run,
    and the other slots send nothing more (a review: they went on sending after run_benchmark raised)."""
    from loadtest import benchmark

    sent = []

    async def fake_send(client, spec, cfg):
        sent.append(spec)
        if len(sent) == 1:
            raise RuntimeError("boom")
        await asyncio.sleep(0.05)
        return RequestRecord(0, 1, 1, send_time=0.0)

    monkeypatch.setattr(benchmark, "send_request", fake_send)

    async def main():
        with pytest.raises(RuntimeError, match="boom"):
            await benchmark.run_benchmark(object(), list(range(200)), None, 4, [0.0] * 200)
        at_raise = len(sent)
        await asyncio.sleep(0.3)
        return at_raise, len(sent)

    at_raise, later = asyncio.run(main())
    assert later == at_raise <= 4
