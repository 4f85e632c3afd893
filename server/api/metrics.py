"""Prometheus metrics of one engine, on its own CollectorRegistry (several engines never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineMetrics:
    def __init__(self, model: str, attention_backend: str, device: str, dtype: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.info = Info("pagewalk", "Static facts about the serving engine", registry=r)
        self.info.info({"model": model, "attention_backend": attention_backend, "device": device,
                        "dtype": dtype})
        self.time_to_first_token = Histogram(
            "pagewalk_time_to_first_token_seconds", "Arrival to first generated token, per choice",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "pagewalk_inter_token_latency_seconds", "Time between consecutive tokens of one choice",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "pagewalk_e2e_request_latency_seconds", "Arrival to the request's end",
            buckets=_E2E_BUCKETS, registry=r)
        self.num_requests_running = Gauge(
            "pagewalk_num_requests_running", "Requests with a sequence holding KV blocks", registry=r)
        self.num_requests_waiting = Gauge(
            "pagewalk_num_requests_waiting", "Requests queued, none of their sequences running", registry=r)
        self.kv_cache_usage_ratio = Gauge(
            "pagewalk_kv_cache_usage_ratio", "Used KV blocks / usable KV blocks", registry=r)
        self.prefix_cache_hit_rate = Gauge(
            "pagewalk_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up",
            registry=r)
        self.num_preemptions = Counter(
            "pagewalk_num_preemptions", "Sequences preempted (recomputed later)", registry=r)
        self.prompt_tokens = Counter(
            "pagewalk_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter(
            "pagewalk_generation_tokens", "Generated tokens, all choices", registry=r)
        self.request_success = Counter(
            "pagewalk_request_success", "Finished choices by finish reason", ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(finish_reason=reason)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """Current value of one sample (for tests and health checks)."""
        return self.registry.get_sample_value(name, labels or {})
