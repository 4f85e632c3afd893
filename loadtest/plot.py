"""PNG plots (matplotlib, Agg): one run's latency distributions and throughput over time; a sweep's curve."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.benchmark import BenchmarkRun  # noqa: E402
from loadtest.metrics import tokens_over_time  # noqa: E402


def plot_run(run: BenchmarkRun, path: str | Path) -> None:
    ok = [r for r in run.records if r.success]
    ttfts = [r.ttft * 1000.0 for r in ok if r.ttft is not None]
    itls = [gap * 1000.0 for r in ok for gap in r.itls]
    bin_s = max(run.duration_s / 50.0, 0.05)
    t, rate = tokens_over_time(run.records, run.start_time, bin_s)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _histogram(axes[0], ttfts, "TTFT (ms)")
    _histogram(axes[1], itls, "ITL (ms)")
    axes[2].step(t, rate, where="post")
    axes[2].set_xlabel("time since first request (s)")
    axes[2].set_ylabel("output tokens/s")
    axes[2].set_title("output throughput over time")
    axes[2].grid(alpha=0.3)
    fig.suptitle(f"{len(ok)} requests, concurrency {run.concurrency}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _histogram(ax, values_ms: list[float], label: str) -> None:
    if values_ms:
        ax.hist(values_ms, bins=min(50, max(5, len(values_ms) // 4)))
        for q, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(values_ms, q))
            ax.axvline(v, color="k", linestyle=style, label=f"p{q} {v:.1f}")
        ax.legend()
    ax.set_xlabel(label)
    ax.set_ylabel("count")
    ax.set_title(f"{label.split()[0]} distribution")
    ax.grid(alpha=0.3)


def plot_sweep(reports: list[dict], path: str | Path) -> None:
    """Output throughput against latency, one point per concurrency level."""
    conc = [r["config"]["concurrency"] for r in reports]
    tput = [r["output_throughput"] for r in reports]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("tpot_ms", "ttft_ms"), strict=True):
        for stat, marker in (("p50", "o-"), ("p99", "s--")):
            lat = [(r.get(metric) or {}).get(stat) for r in reports]
            pts = [(x, y, c) for x, y, c in zip(lat, tput, conc, strict=True) if x is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=stat)
            for x, y, c in pts if stat == "p50" else []:
                ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(f"{metric.removesuffix('_ms').upper()} (ms)")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("throughput vs latency across concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
