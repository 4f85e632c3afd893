"""The server's engine steps around a measured run, from its Prometheus /metrics (best effort).

How many steps the server ran while the run was in flight, how many tokens a step ran on average, and how
many steps held prompt tokens: beside the run's duration they say how full the steps ran and how many went
to prefill (say, the same workload through HTTP and in the engine alone). Read from the tokens-per-step
histogram, pagewalk's `pagewalk_iteration_tokens_total` or vLLM's `vllm:iteration_tokens_total` (its count
and sum, every label set summed), and pagewalk's `pagewalk_engine_steps_total{kind="prompt"}`. A server
without the histogram gives None; steps another client's requests caused in the window count too. Also
pagewalk's mean handoff (`pagewalk_request_handoff_seconds`: a request's arrival to the engine core taking it
in) of the requests that started in the window.
"""

from __future__ import annotations

import re

_HISTOGRAM = re.compile(r"^(?:pagewalk_|vllm:)iteration_tokens_total_(count|sum)(?:\{[^}]*\})?\s+(\S+)\s*$",
                        re.M)
_PROMPT_STEPS = re.compile(r'^pagewalk_engine_steps_total\{[^}]*kind="prompt"[^}]*\}\s+(\S+)\s*$', re.M)
_HANDOFF = re.compile(r"^pagewalk_request_handoff_seconds_(count|sum)(?:\{[^}]*\})?\s+(\S+)\s*$", re.M)


def parse_steps(text: str) -> dict[str, float] | None:
    """{"steps", "tokens": the histogram's count and sum[, "prompt_steps"][, "handoffs", "handoff_s": the
    handoff histogram's count and sum]} from Prometheus text; None without the step histogram."""
    sums: dict[str, float] = {}
    try:
        for kind, value in _HISTOGRAM.findall(text):
            key = "steps" if kind == "count" else "tokens"
            sums[key] = sums.get(key, 0.0) + float(value)
        for kind, value in _HANDOFF.findall(text):
            key = "handoffs" if kind == "count" else "handoff_s"
            sums[key] = sums.get(key, 0.0) + float(value)
        prompt = [float(v) for v in _PROMPT_STEPS.findall(text)]
    except ValueError:
        return None
    if "steps" not in sums or "tokens" not in sums:
        return None
    if prompt:
        sums["prompt_steps"] = sum(prompt)
    return sums


def step_fields(before: dict | None, after: dict | None) -> dict[str, float | None]:
    """The report's server_steps, server_tokens_per_step, server_prompt_steps and server_handoff_ms between
    two readings (None where a reading lacks them or no step ran)."""
    fields: dict[str, float | None] = dict.fromkeys(
        ("server_steps", "server_tokens_per_step", "server_prompt_steps", "server_handoff_ms"))
    if not before or not after:
        return fields
    steps = after["steps"] - before["steps"]
    if steps <= 0:
        return fields
    fields["server_steps"] = steps
    fields["server_tokens_per_step"] = (after["tokens"] - before["tokens"]) / steps
    if "prompt_steps" in before and "prompt_steps" in after:
        fields["server_prompt_steps"] = after["prompt_steps"] - before["prompt_steps"]
    handoffs = after.get("handoffs", 0.0) - before.get("handoffs", 0.0)
    if handoffs > 0 and "handoff_s" in before and "handoff_s" in after:
        fields["server_handoff_ms"] = (after["handoff_s"] - before["handoff_s"]) / handoffs * 1e3
    return fields
