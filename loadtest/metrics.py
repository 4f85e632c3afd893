"""The arithmetic: vLLM `bench serve` definitions over finished request records.

- TTFT: first content chunk - send, per successful request.
- TPOT: (e2el - TTFT) / (output_tokens - 1), per successful request with at least two output tokens.
- ITL: every gap between consecutive content chunks, pooled over successful requests.
- E2EL: completion - send, per successful request.
- duration: first send to last completion (any outcome); throughputs divide by it and count successful
  requests only. Goodput counts the successful requests that meet every given SLO.
Distributions are reported in milliseconds: mean, p50, p90, p99 (linear interpolation, numpy's default)
and max; None when there is nothing to measure.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from loadtest.client import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of_seconds(cls, values: list[float]) -> Distribution | None:
        if not values:
            return None
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(x) for x in np.percentile(ms, PERCENTILES))
        return cls(len(values), float(ms.mean()), p50, p90, p99, float(ms.max()))


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, rec: RequestRecord) -> bool:
        if not rec.success:
            return False
        if self.ttft_ms is not None and (rec.ttft is None or rec.ttft * 1000.0 > self.ttft_ms):
            return False
        if self.tpot_ms is None:
            return True
        if rec.tpot is None:  # a one-token request has no per-token time (vLLM's 0); an unstreamed one was
            return rec.output_tokens <= 1  # never measured: it does not meet a TPOT bound
        return rec.tpot * 1000.0 <= self.tpot_ms


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2el_ms: Distribution | None
    good_requests: int | None = None
    request_goodput: float | None = None
    slo: dict = field(default_factory=dict)


def compute_metrics(
    records: list[RequestRecord], duration_s: float, slo: SLO | None = None
) -> BenchmarkMetrics:
    ok = [r for r in records if r.success]
    errors = Counter(r.error_kind for r in records if not r.success)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    metrics = BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        request_throughput=rate(len(ok)),
        output_throughput=rate(out_tokens),
        total_token_throughput=rate(in_tokens + out_tokens),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        ttft_ms=Distribution.of_seconds([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=Distribution.of_seconds([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=Distribution.of_seconds([gap for r in ok for gap in r.itls]),
        e2el_ms=Distribution.of_seconds([r.e2el for r in ok]),
    )
    if slo is not None and slo.given:
        good = sum(slo.met_by(r) for r in ok)
        metrics.good_requests = good
        metrics.request_goodput = rate(good)
        metrics.slo = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
    return metrics


def tokens_over_time(
    records: list[RequestRecord], start: float, bin_s: float
) -> tuple[list[float], list[float]]:
    """(bin start seconds, output tokens per second) over successful requests, for the throughput plot.

    Each content chunk stands for output_tokens / chunks tokens of its request, so the bins sum to the total.
    """
    ok = [r for r in records if r.success and r.chunk_times]
    if not ok or bin_s <= 0:
        return [], []
    times = np.asarray([t - start for r in ok for t in r.chunk_times])
    weights = np.asarray([r.output_tokens / len(r.chunk_times) for r in ok for _ in r.chunk_times])
    num_bins = int(times.max() // bin_s) + 1
    counts, edges = np.histogram(times, bins=np.arange(num_bins + 1) * bin_s, weights=weights)
    return [float(e) for e in edges[:-1]], [float(c) / bin_s for c in counts]
