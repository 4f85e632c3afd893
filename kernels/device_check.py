"""Where the time goes at small decode shapes (device diagnostic): `python -m kernels.device_check`.

For each shape it reports: host µs per call (CPU launch cost, 200 calls back to back); do_bench median
(L2 cleared before each call, CPU launch overlapping the clear); and the GPU-only cold-L2 time from CUDA-graph
replays of (clear L2; call) minus replays of (clear L2) alone, which removes launch gaps entirely.
Then it times configs x split counts for the small shapes both ways. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kernels.benchmark import Shape, bench_us, gpu_cold_us, host_us
from kernels.split_heuristic import KernelConfig

CONFIGS = [KernelConfig(64, 4, 3), KernelConfig(128, 8, 3), KernelConfig(128, 4, 2), KernelConfig(32, 4, 4),
           KernelConfig(64, 4, 1), KernelConfig(128, 8, 1), KernelConfig(256, 8, 2)]


def sweep_small(shape: Shape, res: dict) -> None:
    """Configs x split counts for one small shape, timed with do_bench and GPU-only."""
    batch, ctx = shape.batch, shape.ctx
    splits = (8, 16, 32, 64) if ctx == 4096 and batch == 1 else (16, 32, 64, 128, 256)
    for cfg in CONFIGS:
        for s in splits:
            if s * cfg.block_n > ctx:
                continue
            row = {"B": batch, "L": ctx, "config": vars(cfg), "splits": s}
            fn = (lambda c=cfg, s=s: shape.ours(s, c))
            try:
                row.update(do_bench_us=bench_us(fn), gpu_cold_us=gpu_cold_us(fn))
            except Exception as exc:  # a config the compiler rejects is reported, not fatal
                row["error"] = str(exc)[:200]
            res["configs"].append(row)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    res = {"overhead": [], "configs": []}
    print("shape         what          host_us  do_bench_us  gpu_cold_us")
    for batch, ctx in ((1, 4096), (1, 32768), (16, 4096), (64, 8192)):
        shape = Shape(batch, ctx, 16)
        for name, fn in (("ours", shape.ours), ("sdpa_contig", shape.sdpa_contig)):
            row = {"B": batch, "L": ctx, "what": name, "host_us": host_us(fn), "do_bench_us": bench_us(fn),
                   "gpu_cold_us": gpu_cold_us(fn)}
            res["overhead"].append(row)
            print(f"({batch},{ctx})".ljust(14) + f"{name:<13} {row['host_us']:8.1f} "
                  f"{row['do_bench_us']:11.1f} {row['gpu_cold_us']:11.1f}", flush=True)
        if batch <= 16:
            sweep_small(shape, res)
        shape = None
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "device_check.json").write_text(json.dumps(res, indent=1))
    for b, ctx in ((1, 4096), (1, 32768), (16, 4096)):
        rows = [r for r in res["configs"] if r["B"] == b and r["L"] == ctx and "error" not in r]
        for key in ("do_bench_us", "gpu_cold_us"):
            best = sorted(rows, key=lambda r: r[key])[:3]
            print(f"({b},{ctx}) best by {key}: " + "; ".join(
                f"{tuple(r['config'].values())} s={r['splits']} db={r['do_bench_us']:.1f} "
                f"gpu={r['gpu_cold_us']:.1f}" for r in best))


if __name__ == "__main__":
    main()
