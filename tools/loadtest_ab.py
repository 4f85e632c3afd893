"""Two load generators against one server, alternating: `python -m tools.loadtest_ab --other DIR`.

The served c256 level has read ~27K tok/s in some runs and ~36K in others on one tree (a tail of requests
reaching the engine ~0.5 s late, its prompts prefilled in many small steps: docs/benchmarks/serving_h100.md).
This starts one `pagewalk serve` (this tree, the bench preset on CUDA, as tools/serving_bench) and runs
`python -m loadtest` at one concurrency from this tree and from DIR (another tree's checkout, e.g. `git
archive`d into .base) in turns, each run with its own seed (fresh prompts, no prefix hits), so a difference
between the two generators shows against the same server, and a run-to-run spread shows within each.
Per run: output tok/s, the server's steps (those with prompt tokens), TTFT p50 / p90, and the spread of the
requests' send times (p90 of their offsets from the run's start). Prints a table last; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tools.serving_bench import IN_LEN, OUT_LEN, URL, start_server, stop_server

REPO = Path(__file__).resolve().parents[1]


def one_run(tree: Path, out: Path, name: str, concurrency: int, seed: int) -> dict:
    path = out / f"{name}.json"
    cmd = [sys.executable, "-m", "loadtest", "--base-url", URL, "--input-len", str(IN_LEN), "--output-len",
           str(OUT_LEN), "--num-requests", str(concurrency), "--concurrency", str(concurrency), "--warmup",
           "8", "--seed", str(seed), "--no-progress", "--processes", "auto", "--out", str(path)]
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p) != REPO]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*site, str(tree)])}
    subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=240,
                   check=True)
    rep = json.loads(path.read_text())
    starts = sorted(r["start_s"] for r in rep["requests"])
    ttft = sorted(r["ttft_ms"] for r in rep["requests"] if r["ttft_ms"] is not None)
    return {"tok_s": rep["output_throughput"], "steps": rep.get("server_steps"),
            "prompt_steps": rep.get("server_prompt_steps"), "ttft_p50_ms": ttft[len(ttft) // 2],
            "ttft_p90_ms": ttft[int(len(ttft) * 0.9)], "send_p90_ms": 1000 * starts[int(len(starts) * 0.9)],
            "client_cpu": rep.get("client_cpu_util")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--other", type=Path, required=True, help="the other tree's root (its loadtest runs)")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("loadtest_ab"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"this": REPO, "other": args.other.resolve()}
    proc = start_server(args.out, ["--max-num-batched-tokens", "8192"])
    runs: dict[str, list[dict]] = {side: [] for side in trees}
    try:
        one_run(REPO, args.out, "warm", args.concurrency, 99)  # first-burst allocations and compiles
        for r in range(args.rounds):
            for k, (side, tree) in enumerate(trees.items()):
                runs[side].append(one_run(tree, args.out, f"{side}{r}", args.concurrency, 1000 + 2 * r + k))
    finally:
        stop_server(proc)
    (args.out / "loadtest_ab.json").write_text(json.dumps(runs, indent=1))
    print(f"c{args.concurrency}, one server; loadtest from this tree and from {args.other}, alternating")
    print("| side | run | tok/s | steps (with prompt) | TTFT p50 / p90 ms | sends p90 ms | client CPU |")
    print("|---|---|---|---|---|---|---|")
    for side, rows in runs.items():
        for i, x in enumerate(rows):
            print(f"| {side} | {i} | {x['tok_s']:,.0f} | {x['steps']:.0f} ({x['prompt_steps']:.0f}) | "
                  f"{x['ttft_p50_ms']:.0f} / {x['ttft_p90_ms']:.0f} | {x['send_p90_ms']:.0f} | "
                  f"{x['client_cpu']:.0%} |")
    for side, rows in runs.items():
        print(f"{side}: median {statistics.median(x['tok_s'] for x in rows):,.0f} tok/s, min "
              f"{min(x['tok_s'] for x in rows):,.0f}")


if __name__ == "__main__":
    main()
