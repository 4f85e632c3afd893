"""TokenHistogram (the per-token histogram of server/api/metrics.py) exposes exactly what prometheus_client's
Histogram with the same name, labels and buckets exposes after the same observations."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from server.api.metrics import _LATENCY_BUCKETS, _TOKEN_BUCKETS, EngineMetrics, TokenHistogram


@pytest.mark.parametrize("buckets", [_LATENCY_BUCKETS, _TOKEN_BUCKETS, (0.5, float("inf"))])
def test_same_exposition_as_prometheus_histogram(buckets):
    reference, ours = CollectorRegistry(), CollectorRegistry()
    hist = Histogram("x_seconds", "doc", ["model_name"], buckets=buckets, registry=reference).labels("m")
    fast = TokenHistogram("x_seconds", "doc", buckets, "m", ours)
    fast.created = hist._created
    rng = random.Random(0)
    values = [0.0, 1e-9, 0.001, 0.0025, 0.00099, 5.0, 1e6, -1.0] + list(buckets[:-1])
    values += [rng.random() * buckets[-2] * 1.5 for _ in range(500)]
    for v in values:
        hist.observe(v)
        fast.observe(v)
    assert generate_latest(ours).decode() == generate_latest(reference).decode()


def test_engine_metrics_reads_the_inter_token_latency():
    m = EngineMetrics("tiny", "torch", "cpu", "float32")
    for v in (0.0015, 0.003, 0.2):
        m.inter_token_latency.observe(v)
    assert m.value("pagewalk_inter_token_latency_seconds_count") == 3
    assert m.value("pagewalk_inter_token_latency_seconds_bucket", {"le": "0.0025"}) == 1
    assert m.value("pagewalk_inter_token_latency_seconds_sum") == pytest.approx(0.2045)


def test_a_slow_request_lands_in_a_finite_bucket():
    # a 30-minute request and a 10-minute first token read a bucket bound, as on vLLM's dashboards (TTFT
    # to 2560 s, request times to 7680 s), not only +Inf past the last finite bound
    m = EngineMetrics("m", "torch", "cpu", "float32")
    m.e2e_request_latency.observe(1800.0)
    m.time_to_first_token.observe(600.0)
    assert m.value("pagewalk_e2e_request_latency_seconds_bucket", {"le": "1920.0"}) == 1
    assert m.value("pagewalk_time_to_first_token_seconds_bucket", {"le": "640.0"}) == 1
