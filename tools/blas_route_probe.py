"""Probe (GPU, not a test): which BLAS route runs the decoder's projections fastest at 1-8192 rows.
`python -m tools.blas_route_probe [--rows 1 16 64 256 8192] [--out JSON]`.

The fused forward's M > 1 route calls nn.Linear (F.linear: cuBLAS through torch's default BLAS library) on
weights stored (N, K). cuBLAS picks its kernel per shape and layout (the decode profile shows split-K with a
separate reduce kernel for down at 64 rows, TNN kernels for o_proj), and cuBLASLt's heuristics may pick
others. This times, per bench projection shape (qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down
2048x8192) and row count M, 16 GEMMs of distinct weights (one per layer: every weight read from memory, not
L2) captured in one CUDA graph, four ways:
- `linear`: F.linear(x, W), W (N, K), torch's default BLAS library (what ships);
- `linear_lt`: the same under torch.backends.cuda.preferred_blas_library("cublaslt");
- `mm_kn`: torch.mm(x, Wt) with Wt = W.t().contiguous() (K, N): the other weight layout;
- `mm_kn_lt`: that under cuBLASLt.
Prints us per GEMM, TB/s (weight bytes) and, at 8192 rows, TFLOP/s, with the ratio to `linear`; checks each
output against `linear`'s. JSON to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from tools.sampler_bench import graph_ms

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
LAYERS = 16
VARIANTS = ("linear", "linear_lt", "mm_kn", "mm_kn_lt")


def calls(variant: str, x: torch.Tensor, ws: list[torch.Tensor], wts: list[torch.Tensor], outs: list):
    """The 16 GEMMs as the forward calls them (no out=: the op the model runs); outs[0] keeps layer 0's."""
    if variant.startswith("linear"):
        def run():
            outs[:] = [torch.nn.functional.linear(x, w) for w in ws]
    else:
        def run():
            outs[:] = [torch.mm(x, w) for w in wts]
    return run


def time_variant(variant: str, x, ws, wts, outs: list, default) -> float:
    torch.backends.cuda.preferred_blas_library("cublaslt" if variant.endswith("_lt") else "cublas")
    try:
        return graph_ms(calls(variant, x, ws, wts, outs), 20) * 1e3 / LAYERS
    finally:
        torch.backends.cuda.preferred_blas_library(default)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 8192])
    ap.add_argument("--out", type=Path, default=Path("blas_route_probe.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    default = torch.backends.cuda.preferred_blas_library()
    default_lib = str(default)
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, generator=gen, device=dev, dtype=torch.bfloat16) * k ** -0.5
              for _ in range(LAYERS)]
        wts = [w.t().contiguous() for w in ws]
        for m in args.rows:
            x = torch.randn(m, k, generator=gen, device=dev, dtype=torch.bfloat16)
            outs: list[torch.Tensor] = []
            expect = torch.nn.functional.linear(x, ws[0]).float()
            for variant in VARIANTS:
                us = time_variant(variant, x, ws, wts, outs, default)
                err = float((outs[0].float() - expect).norm() / expect.norm())
                rows.append({"shape": name, "n": n, "k": k, "rows": m, "variant": variant, "us": us,
                             "TBps": n * k * 2 / us / 1e6, "TFLOPs": 2 * m * n * k / us / 1e6,
                             "rel_err": err})
                outs.clear()
            del outs
        del ws, wts
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "default_blas": default_lib, "layers": LAYERS}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    base = {(r["shape"], r["rows"]): r["us"] for r in rows if r["variant"] == "linear"}
    print(f"{meta['gpu']} torch {meta['torch']} CUDA {meta['cuda']} (default BLAS {default_lib}): "
          f"us per GEMM ({LAYERS} distinct weights in one graph)")
    print("| shape | rows | " + " | ".join(VARIANTS) + " | best vs linear | max rel err |")
    print("|---|---|" + "---|" * (len(VARIANTS) + 2))
    for (shape, m), b in base.items():
        got = {r["variant"]: r for r in rows if r["shape"] == shape and r["rows"] == m}
        unit = (lambda r: f"{r['us']:.1f} ({r['TFLOPs']:.0f} TF/s)") if m >= 1024 else (
            lambda r: f"{r['us']:.2f} ({r['TBps']:.2f} TB/s)")
        best = min(r["us"] for r in got.values())
        print(f"| {shape} | {m} | " + " | ".join(unit(got[v]) for v in VARIANTS)
              + f" | {b / best:.3f}x | {max(r['rel_err'] for r in got.values()):.1e} |")


if __name__ == "__main__":
    main()
