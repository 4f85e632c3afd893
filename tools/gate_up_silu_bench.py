"""Fused gate_up + SiLU benchmark (GPU, not a test): `python -m tools.gate_up_silu_bench [--sweep]
[--out DIR_OR_JSON]`.

The bench model's MLP input at decode sizes, 16 layers' distinct weights (no L2 reuse between layers, as in a
decode step) captured in one CUDA graph and replayed: device µs a layer for what the fused forward ran before
(cuBLAS `F.linear` of the un-normed stream, then kernels/activation.py's SiLU-and-mul applying the folded
norm's row scale) and for kernels/gate_up_silu.py's one launch (the shipped tiles), M in ROWS; the bandwidth
that makes of the weight read once. Every result is checked against the fp32 reference (a wrong one exits
non-zero). `--sweep` also times each configuration of SWEEP at 16 / 32 / 64 rows and prints the best three
per row count (it decides the shipped TILE_CLASSES). Prints a table last; writes JSON to --out (a .json path,
or a directory that gets gate_up_silu_<gpu>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from kernels import gate_up_silu as gus_mod
from kernels.activation import silu_and_mul
from kernels.fused_reference import gate_up_silu_reference
from tools.sampler_bench import graph_ms, out_path
from tools.tile_sweep import best_lines, comparison_lines, sweep_tiles

LAYERS, INTER, K, EPS = 16, 8192, 2048, 1e-5
ROWS = (2, 8, 16, 32, 48, 64, 128)
SWEEP_ROWS = (16, 32, 64)
SWEEP = {"block_n": (32, 64, 128), "block_k": (64, 128), "num_stages": (3, 4), "num_warps": (4, 8)}
ITERS = 20


def operands(rows: int, gen: torch.Generator):
    ws = [(torch.randn(2 * INTER, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16)
          for _ in range(LAYERS)]
    x = (torch.randn(rows, K, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    return ws, x


def unfused(x, w):
    return silu_and_mul(F.linear(x, w), norm_of=x, eps=EPS)


def fused(x, w):
    return gus_mod.gate_up_silu(x, w, EPS)


def time_us(fn, ws, x) -> tuple[float, float]:
    """(µs a layer, rel err of one call against the fp32 reference)."""
    want = gate_up_silu_reference(x, ws[0], EPS).float()
    got = fn(x, ws[0]).float()
    err = float((got - want).abs().max() / want.abs().max())

    def step():
        for w in ws:
            fn(x, w)

    return graph_ms(step, ITERS) * 1e3 / LAYERS, err


def row(rows: int, variant: str, us: float, err: float, **extra) -> dict:
    return {"rows": rows, "variant": variant, "us": us, "TBps": 2 * INTER * K * 2 / (us * 1e-6) / 1e12,
            "rel_err": err, **extra}


def sweep(rows: int, gen: torch.Generator) -> list[dict]:
    ws, x = operands(rows, gen)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    timed = sweep_tiles(gus_mod, SWEEP, lambda cfg: gus_mod.Tiles(block_m, **cfg),
                        lambda: time_us(fused, ws, x))
    return [row(rows, "sweep", us, err, tiles=tiles._asdict()) for tiles, us, err in timed]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for rows in ROWS:
        ws, x = operands(rows, gen)
        us, err = time_us(unfused, ws, x)
        rows_out.append(row(rows, "cuBLAS + silu_and_mul", us, err))
        if rows <= gus_mod.GATE_UP_SILU_MAX_ROWS:
            us, err = time_us(fused, ws, x)
            rows_out.append(row(rows, "gate_up_silu", us, err, tiles=gus_mod.tile_config(rows)._asdict()))
    swept = [r for m in SWEEP_ROWS for r in sweep(m, gen)] if args.sweep else []
    bad = [r for r in rows_out + swept if not r["rel_err"] < 2e-2]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "layers": LAYERS, "intermediate": INTER, "k": K}
    path = out_path(args.out, meta["gpu"], stem="gate_up_silu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows_out, "sweep": swept}, indent=1))
    print(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}: silu(s x Wg^T) * (s x Wu^T), "
          f"x (M, {K}), W ({2 * INTER}, {K}); µs a layer over {LAYERS} layers' weights in one graph; "
          f"JSON {path}")
    for line in best_lines(swept, SWEEP_ROWS) + comparison_lines(rows_out, ROWS, "cuBLAS + silu_and_mul",
                                                                   "gate_up_silu"):
        print(line)
    if bad:
        print(f"WRONG RESULTS: {[(r['rows'], r['variant'], r['rel_err']) for r in bad]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
