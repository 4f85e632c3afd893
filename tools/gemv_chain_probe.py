"""Probe (GPU, not a test) behind kernels/gemv.py: `python -m tools.gemv_chain_probe` (PROBE_BATCH=rows).

The batch-1 decode layer's four GEMVs (bench shape: qkv 3072x2048, o 2048x2048,
gate_up 16384x2048, down 2048x8192; 16 layers = 64 launches, 1.95 GB of weights), chained (each reads the
previous one's output), captured in one CUDA graph:
- cuBLAS F.linear (today);
- a Triton GEMV, one launch each, plain;
- the same with programmatic dependent launch (launch_pdl): each kernel lets the next one launch at its start
  and waits (griddepcontrol.wait) before reading its input, with or without loading its weight tile first.
Prints us per step of 64 and TB/s, and the copy bandwidth of the same run. JSON to $OUT; the run quoted in
kernels/gemv.py and docs/kernel.md is docs/benchmarks/gemv_chain_h200.json (its copy figure came from a
1 GiB copy replayed in a graph, 2.75 TB/s, far below the 4.2 TB/s every other tool measures on the same
GPU; this version times the copy as tools/decode_forward_bench does).
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from tools.kernel_bench import graph_us
from tools.skinny_gemm_probe import SHAPES, cublas_chain, reference, rel_err


@triton.jit
def _gemv(w_ptr, x_ptr, y_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr,
          PREFETCH: tl.constexpr, BATCH: tl.constexpr):
    """y[b, rows] = W[rows, :K] @ x[b, :K] for b < BATCH; the program's whole (BLOCK_N, K) weight tile in one
    load (registers), issued before the wait when PREFETCH."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, K)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :]).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    if not PREFETCH:
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :]).to(tl.float32)
    for b in tl.static_range(BATCH):
        x = tl.load(x_ptr + b * 16384 + rk).to(tl.float32)
        tl.store(y_ptr + b * 16384 + rn, tl.sum(w * x[None, :], 1).to(y_ptr.dtype.element_ty))




def main():
    cpu = "--cpu-check" in sys.argv
    dev = "cpu" if cpu else "cuda"
    dt = torch.float32 if cpu else torch.bfloat16
    layers = 1 if cpu else 16
    torch.manual_seed(0)
    ws = [[(torch.randn(n, k, device=dev) / k ** 0.5).to(dt) for n, k in SHAPES] for _ in range(layers)]
    total_bytes = sum(w.numel() * w.element_size() for lw in ws for w in lw)
    res = {"gpu": "cpu" if cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "layers": layers, "weight_bytes": total_bytes, "rows": []}
    batch = int(os.environ.get("PROBE_BATCH", "1"))
    buf = [torch.randn(batch, 16384, device=dev).to(dt) for _ in range(2)]  # ping-pong, row stride 16384

    x0 = buf[0].clone()
    expect = reference(ws, x0)

    def triton_chain(gdc, prefetch, bn_elems):
        def run():
            i = 0
            for lw in ws:
                for w in lw:
                    n, k = w.shape
                    bn = max(1, bn_elems // k)
                    _gemv[(n // bn,)](w, buf[i % 2], buf[(i + 1) % 2], K=k, BLOCK_N=bn, USE_GDC=gdc,
                                      PREFETCH=prefetch, BATCH=batch, num_warps=4,
                                      **({"launch_pdl": True} if gdc else {}))
                    i += 1
            return buf[i % 2][:, :SHAPES[-1][0]]
        return run

    if cpu:
        for gdc, pre in ((False, False), (False, True)):
            print("triton", gdc, pre, "rel err", rel_err(triton_chain(gdc, pre, 4096), buf, x0, expect))
        return
    from tools.decode_forward_bench import copy_bandwidth

    copy_tbps = copy_bandwidth() / 1e12
    res["copy_TBps"] = copy_tbps
    variants = [("cuBLAS F.linear", cublas_chain(ws, buf))]
    for elems in (8192, 16384, 32768):
        variants += [(f"Triton plain tile {elems}", triton_chain(False, False, elems)),
                     (f"Triton PDL wait-first tile {elems}", triton_chain(True, False, elems)),
                     (f"Triton PDL prefetch tile {elems}", triton_chain(True, True, elems))]
    for name, fn in variants:
        try:
            err = rel_err(fn, buf, x0, expect)
            us = graph_us(fn, reps=30)
            tbps = total_bytes / us / 1e6
            row = {"name": name, "us": us, "TBps": tbps, "of_copy": tbps / copy_tbps, "rel_err": err}
            res["rows"].append(row)
            print(f"{name:36s} {us:8.1f} us {tbps:5.2f} TB/s {row['of_copy']:5.0%} err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"batch {batch}; copy {copy_tbps:.2f} TB/s; weights {total_bytes / 1e9:.2f} GB: "
          f"ideal {total_bytes / copy_tbps / 1e6:.1f} us")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"gemv_pdl_probe_b{batch}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
