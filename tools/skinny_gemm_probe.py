"""Probe (GPU, not a test), issue 16 at 16-256 rows: `python -m tools.skinny_gemm_probe [--rows 16 64 256]`.

The decode layer's four projections (bench shape: qkv 3072x2048, o 2048x2048, gate_up 16384x2048,
down 2048x8192; 16 layers = 64 GEMMs, 1.95 GB of bf16 weights), chained (each reads the previous one's
output), captured in one CUDA graph, at M rows:
- cuBLAS F.linear (what the GEMM route runs at M > 1);
- a Triton tensor-core GEMM (tl.dot), one program per (BLOCK_N columns, BLOCK_M rows) tile looping over K,
  plain launches;
- the same with programmatic dependent launch (kernels/pdl.py's contract): each kernel lets its successor
  launch at once and waits (griddepcontrol.wait) before it reads its input rows, with or without its first
  weight tile loaded before the wait.
At these row counts a decode step's projections read their weights once per step (M x K of input is small),
so the chain's floor is its weight bytes over the copy bandwidth, printed beside each variant. It decides
whether the fused forward's M > 1 route should leave cuBLAS, as kernels/gemv.py did at M = 1
(tools/gemv_chain_probe.py). `--cpu-check` runs the Triton variants on the interpreter (TRITON_INTERPRET=1,
fp32, one layer) against the chained torch reference. JSON to $OUT/skinny_gemm_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # (N, K) of one layer, in order
ROW_STRIDE = 16384  # the ping-pong buffers' row stride: wide enough for every projection's output


@triton.jit
def _gemm_rows(x_ptr, w_ptr, y_ptr, M, N: tl.constexpr, K: tl.constexpr, STRIDE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_GDC: tl.constexpr, PREFETCH: tl.constexpr):
    """y[m, n] = sum_k x[m, k] W[n, k] for the program's (BLOCK_M, BLOCK_N) tile. x, y: (M, STRIDE) row-major;
    W: (N, K) as nn.Linear stores it. N % BLOCK_N == 0 and K % BLOCK_K == 0 (the bench shapes)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm[:, None] < M
    w_tile = w_ptr + rn[:, None] * K + rk[None, :]  # (BLOCK_N, BLOCK_K) at k = 0
    x_tile = x_ptr + rm[:, None] * STRIDE + rk[None, :]  # (BLOCK_M, BLOCK_K) at k = 0
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:  # the first weight tile does not depend on the kernel before: load it during its tail
        w = tl.load(w_tile)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_tile, mask=row_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        start = BLOCK_K
    else:
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
        start = 0
    for k in tl.range(start, K, BLOCK_K):
        w = tl.load(w_tile + k)
        x = tl.load(x_tile + k, mask=row_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + rm[:, None] * STRIDE + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=row_ok)


def block_m_for(rows: int) -> int:
    return min(64, max(16, triton.next_power_of_2(rows)))


def block_n_for(n: int, rows: int, num_sms: int, widest: int) -> int:
    """The widest of 16..`widest` whose grid still gives every SM a program (at least num_sms programs)."""
    m_tiles = triton.cdiv(rows, block_m_for(rows))
    bn = widest
    while bn > 16 and (n // bn) * m_tiles < num_sms:
        bn //= 2
    return bn


def triton_chain(ws, buf, rows, *, gdc, prefetch, block_k, widest_n, num_stages, num_sms):
    bm = block_m_for(rows)
    launches = []
    for lw in ws:
        for w in lw:
            n, k = w.shape
            bn = block_n_for(n, rows, num_sms, widest_n)
            launches.append((w, n, k, (n // bn, triton.cdiv(rows, bm)), bn))
    opts = {"launch_pdl": True} if gdc else {}

    def run():
        for i, (w, n, k, grid, bn) in enumerate(launches):
            _gemm_rows[grid](buf[i % 2], w, buf[(i + 1) % 2], rows, N=n, K=k, STRIDE=ROW_STRIDE, BLOCK_M=bm,
                             BLOCK_N=bn, BLOCK_K=block_k, USE_GDC=gdc, PREFETCH=prefetch, num_warps=4,
                             num_stages=num_stages, **opts)
        return buf[len(launches) % 2][:, :launches[-1][1]]

    return run


def cublas_chain(ws, buf):
    def run():
        i = 0
        for lw in ws:
            for w in lw:
                src, dst = buf[i % 2][:, :w.shape[1]], buf[(i + 1) % 2][:, :w.shape[0]]
                torch.nn.functional.linear(src, w, out=dst)
                i += 1
        return buf[i % 2][:, :ws[-1][-1].shape[0]]

    return run


def reference(ws, x0):
    """The chain in fp32 with the model dtype's rounding after every projection, as the kernels round."""
    x = x0[:, :ws[0][0].shape[1]].float()
    for lw in ws:
        for w in lw:
            x = (x[:, :w.shape[1]] @ w.float().T).to(w.dtype).float()
    return x


def rel_err(fn, buf, x0, expect) -> float:
    buf[0].copy_(x0)
    out = fn().float().clone()
    buf[0].copy_(x0)
    return ((out - expect).abs().max() / expect.abs().max()).item()


def variants(rows):
    """(name, kwargs of triton_chain): the block shapes and launch modes compared at `rows`."""
    out = []
    for block_k, widest_n, stages in ((128, 64, 4), (64, 64, 4), (128, 32, 3)):
        tiles = f"BK{block_k} BN<={widest_n} s{stages}"
        for gdc, prefetch, mode in ((False, False, "plain"), (True, False, "PDL wait-first"),
                                    (True, True, "PDL prefetch")):
            out.append((f"Triton {mode} {tiles}", dict(gdc=gdc, prefetch=prefetch, block_k=block_k,
                                                       widest_n=widest_n, num_stages=stages)))
    return out


def cpu_check() -> None:
    """The Triton variants' math on the interpreter: one layer of the bench shapes scaled down 32x, fp32."""
    torch.manual_seed(0)
    ws = [[torch.randn(n // 32, k // 32) / (k // 32) ** 0.5 for n, k in SHAPES]]  # 96x64 ... 64x256
    for rows in (1, 5, 16, 40):
        buf = [torch.randn(rows, ROW_STRIDE) for _ in range(2)]
        x0 = buf[0].clone()
        expect = reference(ws, x0)
        for prefetch in (False, True):
            run = triton_chain(ws, buf, rows, gdc=False, prefetch=prefetch, block_k=32, widest_n=32,
                               num_stages=2, num_sms=1)
            err = rel_err(run, buf, x0, expect)
            print(f"cpu rows {rows:3d} prefetch {prefetch!s:5s} rel err {err:.1e}")
            assert err < 1e-4, err


def gpu_run(rows_list, out_dir) -> None:
    from tools.decode_forward_bench import copy_bandwidth
    from tools.kernel_bench import graph_us

    torch.manual_seed(0)
    dt = torch.bfloat16
    ws = [[(torch.randn(n, k, device="cuda") / k ** 0.5).to(dt) for n, k in SHAPES] for _ in range(16)]
    weight_bytes = sum(w.numel() * w.element_size() for lw in ws for w in lw)
    copy = copy_bandwidth() / 1e12
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "weight_bytes": weight_bytes, "copy_TBps": copy, "num_sms": num_sms, "rows": {}}
    print(f"{res['gpu']}, torch {torch.__version__}, Triton {triton.__version__}; copy {copy:.2f} TB/s; "
          f"64 GEMMs, {weight_bytes / 1e9:.2f} GB: floor {weight_bytes / copy / 1e6:.1f} us", flush=True)
    table = []
    for rows in rows_list:
        buf = [torch.randn(rows, ROW_STRIDE, device="cuda").to(dt) for _ in range(2)]
        x0 = buf[0].clone()
        expect = reference(ws, x0)
        entries = [("cuBLAS F.linear", cublas_chain(ws, buf))]
        entries += [(name, triton_chain(ws, buf, rows, num_sms=num_sms, **kw)) for name, kw in variants(rows)]
        res["rows"][rows] = []
        for name, fn in entries:
            try:
                err = rel_err(fn, buf, x0, expect)
                buf[0].copy_(x0)
                us = graph_us(fn, reps=30)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                print(f"rows {rows} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            tbps = weight_bytes / us / 1e6
            row = {"name": name, "us": us, "TBps": tbps, "of_copy": tbps / copy, "rel_err": err}
            res["rows"][rows].append(row)
            table.append((rows, row))
            print(f"rows {rows:3d} {name:40s} {us:8.1f} us {tbps:5.2f} TB/s {tbps / copy:5.0%} err {err:.1e}",
                  flush=True)
    with open(os.path.join(out_dir, "skinny_gemm_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n| rows | variant | us | TB/s | of copy | vs cuBLAS |\n|---|---|---|---|---|---|")
    base = {r: next(x["us"] for x in res["rows"][r] if x["name"].startswith("cuBLAS")) for r in res["rows"]}
    for rows, row in table:
        print(f"| {rows} | {row['name']} | {row['us']:.1f} | {row['TBps']:.2f} | {row['of_copy']:.0%} | "
              f"{base[rows] / row['us']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--cpu-check", action="store_true")
    args = ap.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    gpu_run(args.rows, os.environ.get("OUT", "/tmp"))


if __name__ == "__main__":
    main()
