"""Plot docs/benchmarks/structured_outputs_<gpu>.json: `python -m tools.structured_outputs_plot JSON PNG`.

Two panels: the engine's closed loops (output tok/s, free against guided, at each concurrency) and their
decode-only steps (median and p90 ms)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend)


def main(src: Path, out: Path) -> None:
    data = json.loads(src.read_text())
    loops = data["closed_loop"]
    levels = sorted({loop["concurrency"] for loop in loops})
    fig, (ax_tok, ax_step) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    for k, guided in enumerate((False, True)):
        rows = [next(lp for lp in loops if lp["concurrency"] == c and lp["guided"] == guided) for c in levels]
        xs = [i + (k - 0.5) * width for i in range(len(levels))]
        label = "guided ([a-z]+)" if guided else "free"
        ax_tok.bar(xs, [r["tok_s"] for r in rows], width, label=label)
        steps = [r["steps"]["decode_only_wall_ms"] for r in rows]
        ax_step.bar(xs, [s["median"] for s in steps], width, label=label)
        ax_step.errorbar(xs, [s["median"] for s in steps],
                         yerr=[[0] * len(steps), [s["p90"] - s["median"] for s in steps]], fmt="none", c="k")
    for ax, title in ((ax_tok, "closed loop, output tok/s"), (ax_step, "decode-only step ms (median, p90)")):
        ax.set_xticks(range(len(levels)), [f"{c} in flight" for c in levels])
        ax.set_title(title)
        ax.legend()
    meta = data["meta"]
    fig.suptitle(f"structured outputs, {meta['gpu']}, {meta['model']} {meta['dtype']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
