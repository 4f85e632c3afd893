"""Probe (GPU, not a test), issue 16: the MLP's first half of a decode step, the GEMM route against
kernels/gated_gemm.py: `python -m tools.gated_gemm_probe [--rows 2 8 16 32 64 128]`.

Per row count M, the bench shape's gate_up projection (2 x 8192 x 2048 bf16, 67 MB) of 16 layers' distinct
weights (no L2 reuse), in one CUDA graph, from the un-normed residual stream x (M, 2048) on folded norms:
- the GEMM route (what the fused forward ran before): cuBLAS F.linear -> (M, 16384), then
  kernels.activation.silu_and_mul with the row scale of x (two launches a layer);
- kernels.gated_gemm.gated_gemm with norm=True (one launch a layer), at the shipped tile and at each tile of
  a small grid (BLOCK_N, BLOCK_K, stages, warps).
Prints µs a layer, TB/s of weight bytes, the speed against the GEMM route and the max error of each against
the fp32 reference (the GEMM route's own error beside it); the table last. JSON to $OUT/gated_gemm_probe.json.
It decides the kernel's tile and the largest batch the fused forward gives it (kernels.gated_gemm.MAX_ROWS).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

import kernels.gated_gemm as gg
from kernels.activation import silu_and_mul
from kernels.fused_reference import gated_gemm_reference
from tools.decode_split_probe import LAYERS, graph_us  # 16 launches a graph, µs a launch

HIDDEN, INTER, EPS = 2048, 8192, 1e-5
# (BLOCK_N, BLOCK_K, stages, warps): deeper pipelines where the stage fits (a BN64 BK128 stage is 48 KB of the
# H200's 228 KB; tools/splitk_gemm_probe.py found 4 stages ahead of 3 at these shapes)
TILES = [dict(BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=s, NUM_WARPS=w) for bn, bk, s, w in (
    (32, 128, 4, 4), (32, 128, 6, 4), (32, 64, 8, 4),
    (64, 128, 3, 4), (64, 128, 4, 4), (64, 128, 4, 8), (64, 64, 4, 4), (64, 64, 6, 4), (64, 64, 8, 4),
    (128, 64, 4, 4), (128, 64, 4, 8))]


def with_tile(tile: dict):
    """Sets kernels.gated_gemm's tile constants; -> the previous ones."""
    old = {name: getattr(gg, name) for name in tile}
    for name, value in tile.items():
        setattr(gg, name, value)
    return old


def rows_for(m: int, ws, gen) -> list[dict]:
    x = torch.randn(m, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16) * 2.0
    ref = gated_gemm_reference(x.float(), ws[0].float(), norm=True, eps=EPS)  # fp32 throughout
    wbytes = 2 * INTER * HIDDEN * 2
    scale = float(ref.abs().max())

    def gemm_route(layers=ws):
        for w in layers:
            silu_and_mul(F.linear(x, w), norm_of=x, eps=EPS)

    def fused(layers=ws):
        for w in layers:
            gg.gated_gemm(x, w, norm=True, eps=EPS)

    route_err = float((silu_and_mul(F.linear(x, ws[0]), norm_of=x, eps=EPS).float() - ref).abs().max())
    out = [{"rows": m, "variant": "GEMM route", "us": graph_us(gemm_route), "err": route_err / scale}]
    shipped = {name: getattr(gg, name) for name in TILES[0]}
    for tile in [shipped] + [t for t in TILES if t != shipped]:
        old = with_tile(tile)
        try:
            err = float((gg.gated_gemm(x, ws[0], norm=True, eps=EPS).float() - ref).abs().max())
            us = graph_us(fused)
        except triton.runtime.errors.OutOfResources:
            continue  # the tile's stages do not fit in shared memory
        finally:
            with_tile(old)
        label = "BN{BLOCK_N} BK{BLOCK_K} s{NUM_STAGES} w{NUM_WARPS}".format(**tile)
        label = ("shipped " if tile == shipped else "") + label
        out.append({"rows": m, "variant": label, "us": us, "err": err / scale, **tile})
    for r in out:
        r["TBps"] = wbytes / (r["us"] * 1e-6) / 1e12
        r["vs_route"] = out[0]["us"] / r["us"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(2 * INTER, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
          for _ in range(LAYERS)]
    rows = []
    for m in args.rows:
        group = rows_for(m, ws, gen)
        rows += group
        best = min(group[1:], key=lambda r: r["us"])
        print(f"rows {m}: GEMM route {group[0]['us']:.2f} us, shipped {group[1]['us']:.2f}, best "
              f"{best['variant']} {best['us']:.2f}", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "layers": LAYERS, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "gated_gemm_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}; {LAYERS} distinct "
          "weights a graph; µs a layer (gate_up 2 x 8192 x 2048 bf16 + SiLU-and-mul with the folded norm)")
    print("| rows | GEMM route us | shipped tile us | vs route | best tile | us | vs route "
          "| err route / shipped |")
    print("|---|---|---|---|---|---|---|---|")
    for m in args.rows:
        group = [r for r in rows if r["rows"] == m]
        route, shipped = group[0], group[1]
        best = min(group[1:], key=lambda r: r["us"])
        print(f"| {m} | {route['us']:.2f} | {shipped['us']:.2f} | {shipped['vs_route']:.3f} | "
              f"{best['variant']} | {best['us']:.2f} | {best['vs_route']:.3f} | "
              f"{route['err']:.1e} / {shipped['err']:.1e} |")


if __name__ == "__main__":
    main()
