"""Split-K down projection benchmark (GPU, not a test): `python -m tools.splitk_add_bench [--sweep]
[--out DIR_OR_JSON]`.

residual (M, 2048) += act (M, 8192) W^T, the bench model's down projection, 16 layers' distinct weights
(no L2 reuse between layers, as in a decode step) captured in one CUDA graph and replayed: device µs a
layer for cuBLAS (`residual.addmm_`, what the fused forward ran before: nvjet split-K + its reduce kernel)
and kernels/splitk_add.py (the shipped tiles), M in ROWS; the bandwidth that makes of the weight read once.
Every result is checked against the fp32 reference (a wrong one exits non-zero). `--sweep` also times
each configuration of SWEEP at 16 / 32 / 64 rows and prints the best per row count (it decides the
shipped TILE_CLASSES). Prints a table last; writes JSON to --out (a .json path, or a directory
that gets splitk_add_<gpu>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

from kernels import splitk_add as splitk_mod
from kernels.fused_reference import splitk_add_reference
from tools.sampler_bench import graph_ms, out_path
from tools.tile_sweep import best_lines, comparison_lines, sweep_tiles

LAYERS, N, K = 16, 2048, 8192
ROWS = (2, 8, 16, 32, 48, 64, 128)
SWEEP_ROWS = (16, 32, 64)
SWEEP = {"block_n": (32, 64, 128), "block_k": (128, 256), "split_k": (2, 4, 8), "num_stages": (3, 4),
         "num_warps": (4,)}
ITERS = 20


def operands(rows: int, gen: torch.Generator):
    ws = [(torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16)
          for _ in range(LAYERS)]
    x = torch.randn(rows, K, generator=gen, device="cuda").to(torch.bfloat16)
    res = torch.randn(rows, N, generator=gen, device="cuda").to(torch.bfloat16)
    return ws, x, res


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


def time_us(fn, ws, x, res) -> tuple[float, float]:
    """(µs a layer, rel err of one call against the fp32 reference)."""
    start = res.clone()
    want = splitk_add_reference(start.clone(), x, ws[0]).float()
    fn(res, x, ws[0])
    err = rel_err(res, want)
    res.copy_(start)

    def step():
        for w in ws:
            fn(res, x, w)

    return graph_ms(step, ITERS) * 1e3 / LAYERS, err


def cublas(res, x, w):
    res.addmm_(x, w.t())


def row(rows: int, variant: str, us: float, err: float, **extra) -> dict:
    return {"rows": rows, "variant": variant, "us": us, "TBps": N * K * 2 / (us * 1e-6) / 1e12,
            "rel_err": err, **extra}


def tiles_for(rows: int, cfg: dict) -> splitk_mod.Tiles | None:
    """The configuration's tiles at `rows`; None where its K splits do not divide K in BLOCK_K steps."""
    if K % (cfg["block_k"] * cfg["split_k"]):
        return None
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return splitk_mod.Tiles(block_m, cfg["block_n"], cfg["block_k"], cfg["split_k"], cfg["num_stages"],
                            cfg["num_warps"])


def sweep(rows: int, gen: torch.Generator) -> list[dict]:
    ws, x, res = operands(rows, gen)
    timed = sweep_tiles(splitk_mod, SWEEP, lambda cfg: tiles_for(rows, cfg),
                        lambda: time_us(splitk_mod.splitk_add, ws, x, res))
    return [row(rows, "sweep", us, err, tiles=tiles._asdict()) for tiles, us, err in timed]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    splitk_mod.warm_up(torch.device("cuda"))
    rows_out = []
    for rows in ROWS:
        ws, x, res = operands(rows, gen)
        us, err = time_us(cublas, ws, x, res)
        rows_out.append(row(rows, "cuBLAS addmm_", us, err))
        if rows <= splitk_mod.SPLITK_MAX_ROWS:
            us, err = time_us(splitk_mod.splitk_add, ws, x, res)
            rows_out.append(row(rows, "splitk_add", us, err, tiles=splitk_mod.tile_config(rows)._asdict()))
    swept = [r for m in SWEEP_ROWS for r in sweep(m, gen)] if args.sweep else []
    bad = [r for r in rows_out + swept if not r["rel_err"] < 1e-2]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "layers": LAYERS, "n": N, "k": K}
    path = out_path(args.out, meta["gpu"], stem="splitk_add")
    path.write_text(json.dumps({"meta": meta, "rows": rows_out, "sweep": swept}, indent=1))
    print(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}: residual (M, {N}) += "
          f"(M, {K}) W^T, µs a layer over {LAYERS} layers' weights in one graph; JSON {path}")
    for line in (comparison_lines(rows_out, ROWS, "cuBLAS addmm_", "splitk_add")
                 + best_lines(swept, SWEEP_ROWS)):
        print(line)
    if bad:
        print(f"WRONG RESULTS: {[(r['rows'], r['variant'], r['rel_err']) for r in bad]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
