"""Probe (GPU, not a test), issue 16: the GEMM route against kernels/fused_gemm.py for the two projections
it fuses, at a decode step's row counts: `python -m tools.fused_gemm_probe [--rows 8 16 32 64 128]`.

Per row count M, 16 layers' distinct bench-shape weights (no L2 reuse) in one CUDA graph, from the un-normed
residual stream x (M, 2048) on folded norms:
- gate_up (2 x 8192 x 2048 bf16, 67 MB): cuBLAS F.linear -> (M, 16384), then
  kernels.activation.silu_and_mul with the row scale of x (the GEMM route: two launches a layer), against
  kernels.fused_gemm.gated_gemm (one launch);
- qkv (3072 x 2048, 12.6 MB; 32 q heads, 8 kv heads of 64): cuBLAS F.linear, then
  kernels.rope_store.rope_store_kv with the row scale (the K/V of each row stored into a paged cache),
  against kernels.fused_gemm.gemm_rope_store;
- o_proj (2048 x 2048, 8.4 MB) adding into the stream: cuBLAS addmm_ (beta = 1, as the fused forward runs
  it), against kernels.fused_gemm.gemm_add;
each fused kernel at the shipped tile and at each tile of a short list (columns or pairs a program, BLOCK_K,
stages, warps). Prints µs a layer, TB/s of weight bytes, the speed against the GEMM route and the max error
of each against the fp32 reference (the GEMM route's own error beside it); the table last. JSON to
$OUT/fused_gemm_probe.json. It decides the tiles and the largest batch the fused forward gives these kernels
(kernels.fused_gemm.MAX_ROWS).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

import kernels.fused_gemm as fg
from kernels.activation import silu_and_mul
from kernels.fused_reference import gated_gemm_reference, gemm_rope_store_reference
from kernels.rope_store import rope_store_kv
from tools.decode_split_probe import LAYERS, graph_us  # 16 launches a graph, µs a launch

HIDDEN, INTER, EPS, HQ, HKV, D, BLOCK = 2048, 8192, 1e-5, 32, 8, 64, 16
# (columns or pairs a program, BLOCK_K, stages, warps): deeper pipelines where the stage fits (a gated BN64
# BK128 stage is 48 KB of the H200's 228 KB; tools/splitk_gemm_probe.py found 4 stages ahead of 3 here)
TILES = {
    "gate_up": ("BLOCK_N", [(32, 128, 4, 4), (32, 128, 6, 4), (32, 64, 8, 4), (64, 128, 3, 4),
                            (64, 128, 4, 4), (64, 128, 4, 8), (64, 64, 4, 4), (64, 64, 6, 4), (64, 64, 8, 4),
                            (128, 64, 4, 4), (128, 64, 4, 8)]),
    "o_proj": ("BLOCK_ADD_N", [(16, 128, 4, 4), (16, 128, 6, 4), (16, 128, 8, 4), (16, 64, 8, 4),
                                (32, 128, 4, 4), (32, 128, 6, 4), (32, 64, 8, 4)]),
    "qkv": ("BLOCK_P", [(16, 128, 4, 4), (16, 128, 6, 4), (16, 128, 8, 4), (16, 64, 8, 4), (16, 256, 4, 4),
                        (32, 128, 4, 4), (32, 128, 6, 4), (32, 64, 8, 4), (32, 128, 4, 8)]),
}


def tile_of(width_name: str, t: tuple) -> dict:
    return {width_name: t[0], "BLOCK_K": t[1], "NUM_STAGES": t[2], "NUM_WARPS": t[3]}


def with_tile(tile: dict) -> dict:
    """Sets kernels.fused_gemm's tile constants; -> the previous ones."""
    old = {name: getattr(fg, name) for name in tile}
    for name, value in tile.items():
        setattr(fg, name, value)
    return old


def gate_up_case(m: int, gen):
    ws = [torch.randn(2 * INTER, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
          for _ in range(LAYERS)]
    x = torch.randn(m, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16) * 2.0
    ref = gated_gemm_reference(x.float(), ws[0].float(), norm=True, eps=EPS)  # fp32 throughout
    route = lambda w: silu_and_mul(F.linear(x, w), norm_of=x, eps=EPS)  # noqa: E731
    fused = lambda w: fg.gated_gemm(x, w, norm=True, eps=EPS)  # noqa: E731
    return ws, ref, route, fused


def qkv_case(m: int, gen):
    n = (HQ + 2 * HKV) * D
    ws = [torch.randn(n, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
          for _ in range(LAYERS)]
    x = torch.randn(m, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16) * 2.0
    angles = torch.rand(m, D // 2, generator=gen, device="cuda") * 6.0
    cos, sin = angles.cos(), angles.sin()
    blocks = -(-m // BLOCK) + 1
    caches = [torch.zeros(blocks, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.arange(m, device="cuda", dtype=torch.int32)
    kw = dict(cos=cos, sin=sin, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots, num_q_heads=HQ,
              num_kv_heads=HKV)
    f32 = dict(kw, k_cache=caches[0].float(), v_cache=caches[1].float())
    ref = gemm_rope_store_reference(x.float(), ws[0].float(), norm=True, eps=EPS, **f32)

    def route(w):
        qkv = F.linear(x, w)
        rope_store_kv(qkv, cos, sin, caches[0], caches[1], slots, HQ, HKV, norm_of=x, eps=EPS)
        return qkv

    fused = lambda w: fg.gemm_rope_store(x, w, None, norm=True, eps=EPS, **kw)  # noqa: E731
    return ws, ref, route, fused


def o_proj_case(m: int, gen):
    ws = [torch.randn(HIDDEN, HQ * D, generator=gen, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
          for _ in range(LAYERS)]
    x = torch.randn(m, HQ * D, generator=gen, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)
    start = residual.clone()
    ref = (start.float() + x.float() @ ws[0].float().T)

    def from_start(add):  # one add onto the same residual (what the error compares); the timing adds 16
        residual.copy_(start)
        return add(ws[0])

    route = lambda w: residual.addmm_(x, w.t())  # noqa: E731
    fused = lambda w: fg.gemm_add(x, w, residual)  # noqa: E731
    return ws, ref, route, fused, from_start


CASES = {"gate_up": gate_up_case, "qkv": qkv_case, "o_proj": o_proj_case}


def rows_for(name: str, m: int, gen) -> list[dict]:
    ws, ref, route, fused, *once = CASES[name](m, gen)
    first = once[0] if once else (lambda add: add(ws[0]))
    wbytes = ws[0].numel() * 2
    scale = float(ref.abs().max())
    err = lambda fn: float((first(fn).float() - ref).abs().max()) / scale  # noqa: E731
    out = [{"rows": m, "projection": name, "variant": "GEMM route", "err": err(route),
            "us": graph_us(lambda: [route(w) for w in ws])}]
    width_name, tiles = TILES[name]
    shipped = {k: getattr(fg, k) for k in tile_of(width_name, tiles[0])}
    for tile in [shipped] + [t for t in (tile_of(width_name, t) for t in tiles) if t != shipped]:
        old = with_tile(tile)
        try:
            row = {"err": err(fused), "us": graph_us(lambda: [fused(w) for w in ws])}
        except triton.runtime.errors.OutOfResources:
            continue  # the tile's stages do not fit in shared memory
        finally:
            with_tile(old)
        label = f"W{tile[width_name]} BK{tile['BLOCK_K']} s{tile['NUM_STAGES']} w{tile['NUM_WARPS']}"
        out.append({"rows": m, "projection": name, "variant": ("shipped " if tile == shipped else "") + label,
                    **row, **tile})
    for r in out:
        r["TBps"] = wbytes / (r["us"] * 1e-6) / 1e12
        r["vs_route"] = out[0]["us"] / r["us"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in CASES:
        for m in args.rows:
            group = rows_for(name, m, gen)
            rows += group
            best = min(group[1:], key=lambda r: r["us"])
            print(f"{name} rows {m}: GEMM route {group[0]['us']:.2f} us, shipped {group[1]['us']:.2f}, best "
                  f"{best['variant']} {best['us']:.2f}", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "layers": LAYERS, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "fused_gemm_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}; {LAYERS} distinct "
          "weights a graph; µs a layer (GEMM + its elementwise kernel, folded norm; or the fused GEMM)")
    print("| projection | rows | GEMM route us | shipped us | vs route | best tile | us | vs route "
          "| err route / shipped |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in CASES:
        for m in args.rows:
            group = [r for r in rows if r["rows"] == m and r["projection"] == name]
            route, shipped = group[0], group[1]
            best = min(group[1:], key=lambda r: r["us"])
            print(f"| {name} | {m} | {route['us']:.2f} | {shipped['us']:.2f} | {shipped['vs_route']:.3f} | "
                  f"{best['variant']} | {best['us']:.2f} | {best['vs_route']:.3f} | "
                  f"{route['err']:.1e} / {shipped['err']:.1e} |")


if __name__ == "__main__":
    main()
