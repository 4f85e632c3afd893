"""Prometheus metrics of one engine, on its own CollectorRegistry (several engines never collide).

Names, labels and meanings follow vLLM's (`vllm:x` is `pagewalk_x` here), every series labelled with
`model_name`, so a vLLM dashboard carries over by renaming; docs/grafana/pagewalk.json is one. Rates
(throughput, prefix-cache hit rate) are left to the dashboard over counters, so any window can be chosen.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left

import prometheus_client.metrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.utils import floatToGoString

# the top bounds reach vLLM's (TTFT 2560 s, request times 7680 s), so that a dashboard's quantiles of a slow
# request read a bound, not +Inf's last finite one
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 960.0,
                    1920.0, 7680.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# tokens of one engine step: decode batches (the CUDA-graph sizes) up to the default token budget and past it
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_KINDS = ("prompt", "decode")  # steps with prompt tokens (decode rows beside them or not), decode-only
FINISHED_REASONS = ("stop", "length", "abort", "error")


MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode: set before its import


class EngineMetrics:
    """With several API servers (--api-server-count) their supervisor sets MULTIPROC_DIR_ENV, each server's
    values live in files there (prometheus_client's multiprocess mode) and any server's /metrics sums them
    (gauges: the most recent value); the static Info stays per process, as every server holds the same."""

    def __init__(self, model: str, attention_backend: str, device: str, dtype: str):
        self.model_name = model
        self.multiprocess = bool(os.environ.get(MULTIPROC_DIR_ENV))
        self.registry = r = CollectorRegistry()
        self._info_registry = CollectorRegistry() if self.multiprocess else r
        self.info = Info("pagewalk", "Static facts about the serving engine", registry=self._info_registry)
        self.info.info({"model_name": model, "attention_backend": attention_backend, "device": device,
                        "dtype": dtype})

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(model)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=r, multiprocess_mode="mostrecent").labels(model)

        # per token and per request (a request's n choices count as one request)
        self.time_to_first_token = histogram(
            "pagewalk_time_to_first_token_seconds", "Arrival to first generated token, per choice",
            _LATENCY_BUCKETS)
        itl = ("pagewalk_inter_token_latency_seconds", "Time between consecutive tokens of one choice",
               _LATENCY_BUCKETS)
        # multiprocess mode sums what prometheus_client writes to its files; TokenHistogram writes none
        self.inter_token_latency = histogram(*itl) if self.multiprocess else TokenHistogram(*itl, model, r)
        self.e2e_request_latency = histogram(
            "pagewalk_e2e_request_latency_seconds", "Arrival to the request's end", _REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "pagewalk_request_queue_time_seconds", "Arrival to the first engine step that ran the request",
            _REQUEST_BUCKETS)
        # not vLLM's: the API's and the transport's share of the queue time (the core takes adds in between
        # its steps, so a step in flight adds up to its length)
        self.request_handoff_time = histogram(
            "pagewalk_request_handoff_seconds", "Arrival to the engine core taking the request in",
            _LATENCY_BUCKETS)
        self.request_prefill_time = histogram(
            "pagewalk_request_prefill_time_seconds", "First step that ran the request to its first token",
            _REQUEST_BUCKETS)
        self.request_decode_time = histogram(
            "pagewalk_request_decode_time_seconds", "First token to the request's end", _REQUEST_BUCKETS)
        self.request_inference_time = histogram(
            "pagewalk_request_inference_time_seconds", "First step that ran the request to its end",
            _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram(
            "pagewalk_request_prompt_tokens", "Prompt tokens of each finished request", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "pagewalk_request_generation_tokens", "Generated tokens of each finished request, all choices",
            _TOKEN_BUCKETS)
        # the engine's state after each step
        self.num_requests_running = gauge(
            "pagewalk_num_requests_running", "Requests with a sequence holding KV blocks")
        self.num_requests_waiting = gauge(
            "pagewalk_num_requests_waiting", "Requests queued, none of their sequences running")
        self.kv_cache_usage_perc = gauge(
            "pagewalk_kv_cache_usage_perc", "Used KV blocks / usable KV blocks (a fraction, as vLLM's)")
        # totals
        self.prefix_cache_queries = counter(
            "pagewalk_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter(
            "pagewalk_prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.num_preemptions = counter("pagewalk_num_preemptions", "Sequences preempted (recomputed later)")
        # the engine's steps (vLLM's iteration_tokens_total; the steps by kind are pagewalk's): how full the
        # steps run, and how many of them prefill. The counters follow the core's all-time counts; the
        # histogram holds the steps its recording server saw, from its attaching to the core on
        self.iteration_tokens = histogram(
            "pagewalk_iteration_tokens_total", "Tokens (prompt and decode) of each engine step",
            _STEP_TOKEN_BUCKETS)
        engine_steps = Counter("pagewalk_engine_steps", "Engine steps that ran tokens, by kind: 'prompt' "
                               "(prompt tokens, decode rows beside them or not) or 'decode' (decode only)",
                               ["model_name", "kind"], registry=r)
        self.engine_steps = {kind: engine_steps.labels(model, kind) for kind in STEP_KINDS}
        self.prompt_tokens = counter("pagewalk_prompt_tokens",
                                     "Prompt tokens of requests whose prefill ran (at their first token)")
        self.generation_tokens = counter("pagewalk_generation_tokens", "Generated tokens, all choices")
        self._request_success = Counter(
            "pagewalk_request_success", "Finished choices by finished reason",
            ["model_name", "finished_reason"], registry=r)
        self._success_of = {reason: self._request_success.labels(model, reason)
                            for reason in FINISHED_REASONS}

    def exposition(self) -> bytes:
        """The /metrics text: this process's registry, or with several API servers all of theirs."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        summed = CollectorRegistry()
        MultiProcessCollector(summed)
        return generate_latest(self._info_registry) + generate_latest(summed)

    def finished(self, reason: str) -> None:
        """One choice ended with finish_reason `reason`."""
        child = self._success_of.get(reason)  # labels() takes a lock and builds a key each time
        if child is None:
            child = self._success_of[reason] = self._request_success.labels(self.model_name, reason)
        child.inc()

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """Current value of one sample of this model (for tests and health checks)."""
        return self.registry.get_sample_value(name, {"model_name": self.model_name, **(labels or {})})


class TokenHistogram:
    """A one-child Histogram(name, doc, ["model_name"]).labels(model) for what is observed per token: the
    same series on /metrics (tests/test_metrics_histogram.py compares the two), observed with one bisect and
    no locks. prometheus_client's observe costs ~2-3 us (a lock per bucket and per sum, a loop over the
    bounds), ~10% of the API process's CPU per token at 256 streams (docs/benchmarks/api_cpu.md). Observed
    on the event loop only; a scrape reads what is there."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], model: str,
                 registry: CollectorRegistry):
        self.name, self.documentation, self.model = name, documentation, model
        self.bounds = [float(b) for b in buckets]
        if self.bounds[-1] != float("inf"):
            self.bounds.append(float("inf"))
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.created = time.time()
        registry.register(self)

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount: Histogram's bucket
        self.sum += amount

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> list[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        labels = {"model_name": self.model}
        acc = 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            acc += count
            metric.add_sample(self.name + "_bucket", {**labels, "le": floatToGoString(bound)}, acc)
        metric.add_sample(self.name + "_count", labels, acc)
        metric.add_sample(self.name + "_sum", labels, self.sum)
        if prometheus_client.metrics._use_created:  # what disable_created_metrics() turns off
            metric.add_sample(self.name + "_created", labels, self.created)
        return [metric]
