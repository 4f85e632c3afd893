"""`--sweep-concurrency 1,8,32,128`: the same workload at each level, one throughput-vs-latency table."""

from __future__ import annotations

import asyncio
import dataclasses

from rich.console import Console
from rich.table import Table

from loadtest.cpu import busy_warning
from loadtest.prefix_cache import cache_warning
from loadtest.report import failure_warning, fmt
from loadtest.session import RunSettings, Server, measure

COLUMNS = (
    ("completed", "completed", None),
    ("failed", "failed", None),
    ("req/s", "request_throughput", None),
    ("out tok/s", "output_throughput", None),
    ("TTFT p50", "ttft_ms", "p50"),
    ("TTFT p99", "ttft_ms", "p99"),
    ("TPOT p50", "tpot_ms", "p50"),
    ("TPOT p99", "tpot_ms", "p99"),
    ("ITL p50", "itl_ms", "p50"),
    ("E2EL p50", "e2el_ms", "p50"),
    ("client procs", "client_processes", None),
    ("client busy max", "client_busy_max", None),
)


LEVEL_SEED_STRIDE = 1_000_003  # apart from each other and from the warm-up's seed + 7919


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"expected comma-separated concurrency levels >= 1, got {text!r}")
    return levels


async def run_sweep(
    settings: RunSettings,
    server: Server,
    levels: list[int],
    stop: asyncio.Event | None = None,
    console: Console | None = None,
) -> list[dict]:
    """One report per level, in order; stops early (keeping the finished levels) when `stop` is set. Each
    level draws its own prompts (seed + i * LEVEL_SEED_STRIDE): the same prompts again would be served from
    the prefix cache the level before filled, and the later levels would measure no prefill."""
    reports = []
    for i, level in enumerate(levels):
        level_settings = dataclasses.replace(settings, seed=settings.seed + i * LEVEL_SEED_STRIDE)
        _, report = await measure(level_settings, server, level, stop, console)
        reports.append(report)
        if report["interrupted"]:
            break
    return reports


def sweep_table(reports: list[dict]) -> Table:
    table = Table(title="concurrency sweep (latencies in ms)", title_justify="left")
    table.add_column("concurrency", justify="right")
    for header, _, _ in COLUMNS:
        table.add_column(header, justify="right")
    for r in reports:
        cells = []
        for _, key, stat in COLUMNS:
            value = r.get(key) if stat is None else (r.get(key) or {}).get(stat)
            cells.append(fmt(value))
        suffix = " (interrupted)" if r["interrupted"] else ""
        table.add_row(str(r["config"]["concurrency"]) + suffix, *cells)
    return table


def sweep_warnings(reports: list[dict]) -> list[str]:
    """One line per level whose requests failed, whose load generator may have been the bottleneck or whose
    prompts the server mostly found in its prefix cache."""
    lines = []
    for r in reports:
        for warning in (failure_warning(r), busy_warning(r), cache_warning(r)):
            if warning:
                lines.append(f"concurrency {r['config']['concurrency']}: {warning}")
    return lines
