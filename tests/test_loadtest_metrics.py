"""loadtest metric arithmetic on hand-built records (no server)."""

import math

import pytest

from loadtest.benchmark import BenchmarkRun
from loadtest.client import RequestRecord
from loadtest.metrics import SLO, Distribution, compute_metrics, tokens_over_time


def record(index, send, chunks, end, tokens, input_len=10, error_kind=None, streamed=True):
    rec = RequestRecord(index, input_len, tokens, send_time=send, end_time=end, chunk_times=list(chunks),
                        output_tokens=tokens, streamed=streamed, error_kind=error_kind)  # fmt: skip
    return rec


@pytest.fixture
def records():
    a = record(0, 0.00, [0.10, 0.15, 0.25], 0.25, 3, input_len=10)  # ttft 100, itl 50/100, tpot 75, e2el 250
    b = record(1, 0.05, [0.25, 0.30], 0.31, 2, input_len=20)  # ttft 200, itl 50, tpot 60, e2el 260
    c = record(2, 0.10, [0.20], 0.40, 0, error_kind="http_500")
    d = record(3, 0.12, [], 0.50, 0, error_kind="stream_dropped")
    return [a, b, c, d]


def test_per_request_definitions(records):
    a, b = records[0], records[1]
    assert a.ttft == pytest.approx(0.10)
    assert a.itls == pytest.approx([0.05, 0.10])
    assert a.tpot == pytest.approx((0.25 - 0.10) / 2)
    assert b.e2el == pytest.approx(0.26)
    assert b.tpot == pytest.approx(0.06)
    one_token = record(4, 0.0, [0.1], 0.1, 1)
    assert one_token.tpot is None and one_token.itls == []
    unary = record(5, 0.0, [0.3], 0.3, 5, streamed=False)
    assert unary.ttft == pytest.approx(0.3) and unary.tpot is None


def test_distributions_and_throughput(records):
    m = compute_metrics(records, duration_s=0.5)
    assert (m.completed, m.failed) == (2, 2)
    assert m.errors == {"http_500": 1, "stream_dropped": 1}
    assert m.total_output_tokens == 5 and m.total_input_tokens == 30
    assert m.output_throughput == pytest.approx(10.0)
    assert m.request_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(70.0)
    # ttft [100, 200]: linear interpolation between the two
    assert m.ttft_ms.count == 2
    assert (m.ttft_ms.mean, m.ttft_ms.p50, m.ttft_ms.p90, m.ttft_ms.p99, m.ttft_ms.max) == pytest.approx(
        (150.0, 150.0, 190.0, 199.0, 200.0)
    )
    # itl pooled over successful requests: [50, 100, 50]; the failed request's chunks do not count
    assert m.itl_ms.count == 3
    assert (m.itl_ms.mean, m.itl_ms.p50, m.itl_ms.p90, m.itl_ms.p99, m.itl_ms.max) == pytest.approx(
        (200.0 / 3, 50.0, 90.0, 99.0, 100.0)
    )
    assert (m.tpot_ms.mean, m.tpot_ms.max) == pytest.approx((67.5, 75.0))
    assert (m.e2el_ms.mean, m.e2el_ms.p50) == pytest.approx((255.0, 255.0))
    assert m.request_goodput is None and m.good_requests is None


def test_percentiles_match_numpy_on_many_values():
    values = [((i * 37) % 101) / 1000.0 for i in range(1, 500)]
    dist = Distribution.of_seconds(values)
    ms = sorted(v * 1000.0 for v in values)

    def interp(q):  # linear interpolation between closest ranks
        rank = q / 100 * (len(ms) - 1)
        lo, hi = math.floor(rank), math.ceil(rank)
        return ms[lo] + (rank - lo) * (ms[hi] - ms[lo])

    assert dist.p50 == pytest.approx(interp(50))
    assert dist.p90 == pytest.approx(interp(90))
    assert dist.p99 == pytest.approx(interp(99))
    assert dist.max == pytest.approx(ms[-1]) and dist.mean == pytest.approx(sum(ms) / len(ms))
    assert Distribution.of_seconds([]) is None


@pytest.mark.parametrize(
    "slo, good",
    [
        (SLO(ttft_ms=150), 1),  # a (100) meets it, b (200) does not
        (SLO(tpot_ms=70), 1),  # b (60) meets it, a (75) does not
        (SLO(ttft_ms=150, tpot_ms=70), 0),
        (SLO(ttft_ms=1000, tpot_ms=1000), 2),  # failed requests are never good
    ],
)
def test_goodput(records, slo, good):
    m = compute_metrics(records, duration_s=0.5, slo=slo)
    assert m.good_requests == good
    assert m.request_goodput == pytest.approx(good / 0.5)
    assert m.slo == {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}


def test_one_token_request_passes_tpot_slo():
    m = compute_metrics([record(0, 0.0, [0.01], 0.01, 1)], 0.01, SLO(tpot_ms=1.0))
    assert m.good_requests == 1


def test_duration_is_first_send_to_last_completion(records):
    run = BenchmarkRun(records=records, num_requested=4, concurrency=2)
    assert run.start_time == 0.0 and run.end_time == 0.5
    assert run.duration_s == pytest.approx(0.5)
    assert BenchmarkRun(records=[], num_requested=0, concurrency=1).duration_s == 0.0


def test_empty_run_has_no_distributions():
    m = compute_metrics([], duration_s=0.0)
    assert m.completed == 0 and m.output_throughput == 0.0 and m.ttft_ms is None and m.itl_ms is None


def test_tokens_over_time_sums_to_output_tokens(records):
    starts, rates = tokens_over_time(records, start=0.0, bin_s=0.125)
    assert starts == pytest.approx([0.0, 0.125, 0.25])
    # chunks at 0.10 | 0.15 | 0.25, 0.25, 0.30 (one token each; the failed request's chunk is ignored)
    assert rates == pytest.approx([8.0, 8.0, 24.0])
    assert sum(r * 0.125 for r in rates) == pytest.approx(5.0)
    doubled = [record(0, 0.0, [0.1, 0.2], 0.2, 4)]  # 4 tokens in 2 chunks: each chunk carries 2
    assert tokens_over_time(doubled, 0.0, 0.125)[1] == pytest.approx([16.0, 16.0])
