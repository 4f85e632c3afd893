"""Fused qkv + RoPE + K/V store benchmark (GPU, not a test): `python -m tools.qkv_rope_bench [--sweep]
[--out DIR_OR_JSON]`.

The bench model's attention input at decode sizes, 16 layers' distinct weights and caches (no L2 reuse
between layers, as in a decode step) captured in one CUDA graph and replayed: device µs a layer for what the
fused forward ran before (cuBLAS `F.linear` of the un-normed stream, then kernels/rope_store.py's kernel
applying the folded norm's row scale, RoPE and the store) and for kernels/qkv_rope_store.py's one launch
(the shipped tiles), M in ROWS; the bandwidth that makes of the weight read once. Every result (qkv rows and
the cache slots written) is checked against the fp32 reference (a wrong one exits non-zero). `--sweep` also
times each configuration of SWEEP at 16 / 32 / 64 rows and prints the best three per row count (it decides
the shipped TILE_CLASSES). Prints a table last; writes JSON to --out (a .json path, or a directory that
gets qkv_rope_<gpu>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from kernels import qkv_rope_store as qrs_mod
from kernels.fused_reference import qkv_rope_store_reference
from kernels.rope_store import rope_store_kv
from tools.sampler_bench import graph_ms, out_path
from tools.tile_sweep import best_lines, comparison_lines, sweep_tiles

LAYERS, HQ, HKV, D, K, EPS, BLOCK = 16, 32, 8, 64, 2048, 1e-5, 16
N = (HQ + 2 * HKV) * D
ROWS = (2, 8, 16, 32, 48, 64, 128)
SWEEP_ROWS = (16, 32, 64)
SWEEP = {"block_h": (16, 32), "block_k": (64, 128), "split_k": (1, 2, 4), "num_stages": (4, 6),
         "num_warps": (4,)}
ITERS = 20


class Layers:
    """LAYERS layers' weights and caches, one row batch: x (rows, K), cos/sin of random positions, slots."""

    def __init__(self, rows: int, gen: torch.Generator) -> None:
        self.ws = [(torch.randn(N, K, generator=gen, device="cuda") * K ** -0.5).to(torch.bfloat16)
                   for _ in range(LAYERS)]
        self.x = (torch.randn(rows, K, generator=gen, device="cuda") * 3).to(torch.bfloat16)
        blocks = rows // BLOCK + 2
        self.caches = [torch.zeros(2, blocks, BLOCK, HKV, D, dtype=torch.bfloat16, device="cuda")
                       for _ in range(LAYERS)]
        self.slots = torch.randperm(blocks * BLOCK, generator=gen, device="cuda")[:rows]
        positions = torch.randint(0, 4096, (rows,), generator=gen, device="cuda")
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        angles = positions.float()[:, None] * inv_freq[None, :]
        self.cos, self.sin = angles.cos(), angles.sin()

    def args(self, layer: int) -> dict:
        k_cache, v_cache = self.caches[layer]
        return dict(eps=EPS, cos=self.cos, sin=self.sin, k_cache=k_cache, v_cache=v_cache,
                    slot_mapping=self.slots, num_q_heads=HQ, num_kv_heads=HKV)


def unfused(x, w, *, eps, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads):
    qkv = F.linear(x, w)
    rope_store_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, norm_of=x,
                  eps=eps)
    return qkv


def fused(x, w, **kw):
    return qrs_mod.qkv_rope_store(x, w, None, **kw)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def time_us(fn, layers: Layers) -> tuple[float, float]:
    """(µs a layer, rel err of one call's qkv rows and written K/V against the fp32 reference)."""
    ref_k, ref_v = (c.clone() for c in layers.caches[0])
    ref = layers.args(0) | {"k_cache": ref_k, "v_cache": ref_v}
    want = qkv_rope_store_reference(layers.x, layers.ws[0], None, **ref)
    got = fn(layers.x, layers.ws[0], **layers.args(0))
    k_cache, v_cache = layers.caches[0]
    slots = layers.slots
    err = max(rel_err(got, want), *(rel_err(c.flatten(0, 1)[slots], r.flatten(0, 1)[slots])
                                    for c, r in ((k_cache, ref_k), (v_cache, ref_v))))

    def step():
        for i, w in enumerate(layers.ws):
            fn(layers.x, w, **layers.args(i))

    return graph_ms(step, ITERS) * 1e3 / LAYERS, err


def row(rows: int, variant: str, us: float, err: float, **extra) -> dict:
    return {"rows": rows, "variant": variant, "us": us, "TBps": N * K * 2 / (us * 1e-6) / 1e12,
            "rel_err": err, **extra}


def sweep(rows: int, gen: torch.Generator) -> list[dict]:
    layers = Layers(rows, gen)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    timed = sweep_tiles(qrs_mod, SWEEP, lambda cfg: qrs_mod.Tiles(block_m, **cfg),
                        lambda: time_us(fused, layers))
    return [row(rows, "sweep", us, err, tiles=tiles._asdict()) for tiles, us, err in timed]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for rows in ROWS:
        layers = Layers(rows, gen)
        us, err = time_us(unfused, layers)
        rows_out.append(row(rows, "cuBLAS + rope_store", us, err))
        if rows <= qrs_mod.QKV_ROPE_MAX_ROWS:
            us, err = time_us(fused, layers)
            tiles = qrs_mod.tile_config(rows, D)._asdict()
            rows_out.append(row(rows, "qkv_rope_store", us, err, tiles=tiles))
    swept = [r for m in SWEEP_ROWS for r in sweep(m, gen)] if args.sweep else []
    bad = [r for r in rows_out + swept if not r["rel_err"] < 2e-2]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "layers": LAYERS, "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "k": K}
    path = out_path(args.out, meta["gpu"], stem="qkv_rope")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows_out, "sweep": swept}, indent=1))
    print(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}: qkv = s x W^T, RoPE, K/V store; "
          f"x (M, {K}), W ({N}, {K}); µs a layer over {LAYERS} layers' weights in one graph; JSON {path}")
    for line in best_lines(swept, SWEEP_ROWS) + comparison_lines(rows_out, ROWS, "cuBLAS + rope_store",
                                                                   "qkv_rope_store"):
        print(line)
    if bad:
        print(f"WRONG RESULTS: {[(r['rows'], r['variant'], r['rel_err']) for r in bad]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
