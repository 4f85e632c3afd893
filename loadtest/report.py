"""The report: one flat JSON document per run (vLLM-like field names), a stdout table, and `compare`."""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loadtest.benchmark import BenchmarkRun
from loadtest.cpu import busy_warning, load_fields
from loadtest.metrics import BenchmarkMetrics
from loadtest.prefix_cache import cache_warning

DISTRIBUTIONS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
STATS = ("mean", "p50", "p90", "p99", "max")
SCALARS = (
    "completed", "failed", "duration_s", "request_throughput", "output_throughput",
    "total_token_throughput", "total_input_tokens", "total_output_tokens", "request_goodput",
)  # fmt: skip
CLIENT_LOAD = ("client_processes", "client_cpu_s", "client_cpu_util", "client_busy_max")
# what the server's /metrics said of the run, where it says it (prefix_cache.py, server_steps.py)
SERVER = ("server_prefix_cache_hit_rate", "server_steps", "server_tokens_per_step", "server_prompt_steps",
          "server_handoff_ms")
HIGHER_IS_BETTER = {"completed", "request_throughput", "output_throughput", "total_token_throughput",
                    "request_goodput", "total_output_tokens", "total_input_tokens"}  # fmt: skip


def build_report(
    run: BenchmarkRun,
    metrics: BenchmarkMetrics,
    config: dict,
    command: str,
    health: dict | None,
    detailed: bool = False,
) -> dict:
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "config": config,
        "interrupted": run.interrupted,
        "num_requested": run.num_requested,
        # the first send as a perf_counter time (CLOCK_MONOTONIC on Linux: one clock across processes),
        # so a server-side sampler can align its samples with the measured window
        "start_perf_counter_s": run.start_time,
        **dataclasses.asdict(metrics),
        **load_fields(run.loads),
        "server_health": health,
        "client": {
            "python": platform.python_version(),
            "host": platform.node(),
            "loads": [dataclasses.asdict(x) for x in run.loads],  # one per process: role, cpu_s, wall_s
        },
        "requests": [_request_row(r, run.start_time, detailed) for r in run.records],
    }
    return report


def _request_row(rec, start: float, detailed: bool) -> dict:
    ms = lambda s: None if s is None else s * 1000.0
    row = {
        "index": rec.index,
        "success": rec.success,
        "error_kind": rec.error_kind,
        "error": rec.error or None,
        "input_len": rec.input_len,
        "output_tokens": rec.output_tokens,
        "start_s": rec.send_time - start,
        "ttft_ms": ms(rec.ttft),
        "tpot_ms": ms(rec.tpot),
        "e2el_ms": ms(rec.e2el),
    }
    if detailed:
        row["chunk_times_s"] = [t - start for t in rec.chunk_times]
    return row


def save_report(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def load_report(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{value:,.2f}"


def failure_warning(report: dict) -> str | None:
    """A line when measured requests failed: the throughputs and latencies count the completed ones only."""
    failed = report.get("failed") or 0
    if not failed:
        return None
    kinds = ", ".join(f"{kind} {n}" for kind, n in report.get("errors", {}).items())
    total = failed + report.get("completed", 0)
    return (f"{failed} of {total} measured requests failed ({kinds}): the figures count the completed ones "
            "only")


def failed_share(report: dict) -> float:
    """The share of a report's measured requests that failed (0 when none finished)."""
    total = (report.get("failed") or 0) + report.get("completed", 0)
    return (report.get("failed") or 0) / total if total else 0.0


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    title = "pagewalk loadtest" + (" (INTERRUPTED: partial results)" if report.get("interrupted") else "")
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    cfg = report.get("config", {})
    for key in ("endpoint", "model", "concurrency", "request_rate", "input_len", "output_len"):
        if key in cfg:
            table.add_row(key, str(cfg[key]))
    table.add_row("requested", str(report.get("num_requested")))
    for key in SCALARS:
        if report.get(key) is not None:
            table.add_row(key, fmt(report[key]))
    if report.get("slo"):
        slo = ", ".join(f"{k}<={v}" for k, v in report["slo"].items() if v is not None)
        table.add_row("good_requests", f"{report['good_requests']} ({slo})")
    for kind, n in report.get("errors", {}).items():
        table.add_row(f"errors.{kind}", str(n))
    for key in CLIENT_LOAD + SERVER:
        if report.get(key) is not None:
            table.add_row(key, fmt(report[key]))
    console.print(table)
    console.print(distribution_table(report))
    for warning in (failure_warning(report), busy_warning(report), cache_warning(report)):
        if warning:
            console.print(f"[yellow]{warning}[/]", soft_wrap=True)
    health = report.get("server_health")
    if health:
        console.print("server /health: " + json.dumps(health, separators=(",", ":")), soft_wrap=True)


def distribution_table(report: dict) -> Table:
    table = Table(title="latency (ms)", title_justify="left")
    table.add_column("")
    for stat in STATS:
        table.add_column(stat, justify="right")
    for name in DISTRIBUTIONS:
        dist = report.get(name) or {}
        table.add_row(name.removesuffix("_ms"), *(fmt(dist.get(s)) for s in STATS))
    return table


def compare_rows(a: dict, b: dict) -> list[tuple[str, float | None, float | None, float | None]]:
    """(metric, A, B, B/A) for every scalar and latency statistic both reports can have."""
    rows = []
    keys = list(SCALARS) + list(SERVER) + [f"{d}.{s}" for d in DISTRIBUTIONS for s in STATS]
    for key in keys:
        va, vb = _lookup(a, key), _lookup(b, key)
        if va is None and vb is None:
            continue
        if va is None or vb is None or va == vb == 0:
            ratio = None
        else:  # from 0 to more (0 failures to 5): an infinite ratio, so that it is marked
            ratio = vb / va if va != 0 else math.copysign(math.inf, vb)
        rows.append((key, va, vb, ratio))
    return rows


def _lookup(report: dict, key: str) -> float | None:
    value: object = report
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def print_compare(a: dict, b: dict, names: tuple[str, str], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"A = {names[0]}   B = {names[1]}", title_justify="left")
    for col, justify in (("metric", "left"), ("A", "right"), ("B", "right"), ("B/A", "right")):
        table.add_column(col, justify=justify)
    for key, va, vb, ratio in compare_rows(a, b):
        better = _better(key, ratio)
        ratio_text = "-" if ratio is None else "from 0" if math.isinf(ratio) else f"{ratio:.3f}x"
        style = {True: "green", False: "red", None: ""}[better]
        table.add_row(key, fmt(va), fmt(vb), f"[{style}]{ratio_text}[/]" if style else ratio_text)
    console.print(table)


def _better(key: str, ratio: float | None) -> bool | None:
    if ratio is None or ratio == 1.0 or key in ("duration_s", "total_input_tokens", *SERVER):
        return None
    return (ratio > 1.0) == (key.split(".")[0] in HIGHER_IS_BETTER)
