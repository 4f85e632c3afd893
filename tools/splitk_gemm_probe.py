"""Probe (GPU, not a test), issue 16 at 16-256 rows, one projection at a time:
`python -m tools.splitk_gemm_probe [--rows 16 64 256]`.

tools/skinny_gemm_probe.py found no Triton tile that beats cuBLAS over the whole chain of a step's 64
projections. Its tiles cover N with BLOCK_N-wide programs and the whole K in one program, so the two small
projections (o_proj 2048 x 2048 and qkv 3072 x 2048 in the `bench` shape) run on 32-96 programs of 132 SMs;
cuBLAS takes 6-7 us for them at 64 rows (1.2-2.1 TB/s). This probe times each projection alone, 16 layers'
distinct weights (no L2 reuse) in one CUDA graph, y = x W^T at M rows:
- cuBLAS (torch.mm into a preallocated output, as the GEMM route's F.linear runs);
- a Triton tensor-core GEMM with split-K: grid (N / BLOCK_N, SPLIT_K, M tiles), each program one K range;
  the programs of a column tile write fp32 partials, and the one that draws the last ticket of its tile
  sums them in split order (deterministic) and writes the bf16 output, as kernels/paged_decode.py merges
  its splits in one launch. SPLIT_K 1 writes directly.
Prints µs per projection, TB/s of weight bytes and the speed against cuBLAS for each (rows, shape); the best
variant per (rows, shape) last. JSON to $OUT/splitk_gemm_probe.json. It decides whether the fused forward's
M > 1 route should take such a GEMM for some projections.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import triton.language as tl

from tools.decode_split_probe import LAYERS, graph_us  # 16 launches a graph, µs a launch

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


@triton.jit
def _splitk_gemm(X, W, Y, PART, TICKETS, M, N, K, k_per_split, split_k,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y (M, N) = X (M, K) W (N, K)^T for the program's (BLOCK_M, BLOCK_N) tile over K range
    [pid_k * k_per_split, +k_per_split). N % BLOCK_N == 0, k_per_split % BLOCK_K == 0 (the bench shapes)."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm[:, None] < M
    k0 = pid_k * k_per_split
    x_ptrs = X + rm[:, None].to(tl.int64) * K + (k0 + rk)[None, :]
    w_ptrs = W + rn[:, None].to(tl.int64) * K + (k0 + rk)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y + rm[:, None] * N + rn[None, :]
    if split_k == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok)
    else:
        m_pad = tl.num_programs(2) * BLOCK_M
        part = PART + rm[:, None] * N + rn[None, :]
        tl.store(part + pid_k * m_pad * N, acc)
        tl.debug_barrier()  # every thread's partial stored before the ticket is released
        counter = TICKETS + pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == split_k - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, split_k):
                total += tl.load(part + s * m_pad * N)
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=m_ok)
            tl.store(counter, 0)


def variants(m: int, n: int, k: int):
    block_m = 16 if m <= 16 else 64
    for block_n, block_k, split_k, stages in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8),
                                                               (3, 4)):
        if n % block_n or k % (block_k * split_k):
            continue
        yield {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "split_k": split_k,
               "num_stages": stages}


def shape_rows(m: int, name: str, n: int, k: int, gen: torch.Generator) -> list[dict]:
    ws = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) * k ** -0.5
          for _ in range(LAYERS)]
    x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ ws[0].float().t()
    wbytes = n * k * 2

    def cublas():
        for w in ws:
            torch.mm(x, w.t(), out=y)

    rows = [{"rows": m, "shape": name, "variant": "cuBLAS", "us": graph_us(cublas)}]
    tickets = torch.zeros(4096, dtype=torch.int32, device="cuda")
    for v in variants(m, n, k):
        m_tiles = triton.cdiv(m, v["BLOCK_M"])
        part = torch.empty(v["split_k"] * m_tiles * v["BLOCK_M"] * n, device="cuda", dtype=torch.float32)
        grid = (n // v["BLOCK_N"], v["split_k"], m_tiles)
        k_per = k // v["split_k"]

        def triton_gemm(v=v, part=part, grid=grid, k_per=k_per):
            for w in ws:
                _splitk_gemm[grid](x, w, y, part, tickets, m, n, k, k_per, v["split_k"], BLOCK_M=v["BLOCK_M"],
                                   BLOCK_N=v["BLOCK_N"], BLOCK_K=v["BLOCK_K"], num_warps=4,
                                   num_stages=v["num_stages"])

        y.fill_(float("nan"))
        try:
            _splitk_gemm[grid](x, ws[0], y, part, tickets, m, n, k, k_per, v["split_k"], BLOCK_M=v["BLOCK_M"],
                               BLOCK_N=v["BLOCK_N"], BLOCK_K=v["BLOCK_K"], num_warps=4,
                               num_stages=v["num_stages"])
        except triton.runtime.errors.OutOfResources:
            continue  # the tile's stages do not fit in shared memory
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        label = f"BN{v['BLOCK_N']} BK{v['BLOCK_K']} SK{v['split_k']} s{v['num_stages']}"
        rows.append({"rows": m, "shape": name, "variant": label, "us": graph_us(triton_gemm), "rel_err": err,
                     **v})
    for r in rows:
        r["TBps"] = wbytes / (r["us"] * 1e-6) / 1e12
        r["vs_cublas"] = rows[0]["us"] / r["us"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m in args.rows:
        for name, (n, k) in SHAPES.items():
            rows += shape_rows(m, name, n, k, gen)
            group = [r for r in rows if r["rows"] == m and r["shape"] == name]
            best = min(group[1:], key=lambda r: r["us"])
            print(f"rows {m} {name}: cuBLAS {group[0]['us']:.2f} us, best {best['variant']} "
                  f"{best['us']:.2f} us (err {best['rel_err']:.1e})", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "layers": LAYERS, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "splitk_gemm_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}; {LAYERS} distinct weights "
          "a graph; best Triton split-K variant per (rows, projection)")
    print("| rows | projection | cuBLAS us | cuBLAS TB/s | best Triton | us | TB/s | vs cuBLAS | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in args.rows:
        for name in SHAPES:
            group = [r for r in rows if r["rows"] == m and r["shape"] == name]
            base = group[0]
            ok = [r for r in group[1:] if r["rel_err"] < 2e-2]
            best = min(ok, key=lambda r: r["us"]) if ok else None
            if best is None:
                print(f"| {m} | {name} | {base['us']:.2f} | {base['TBps']:.2f} | none correct | | | | |")
                continue
            print(f"| {m} | {name} | {base['us']:.2f} | {base['TBps']:.2f} | {best['variant']} | "
                  f"{best['us']:.2f} | {best['TBps']:.2f} | {best['vs_cublas']:.2f} | "
                  f"{best['rel_err']:.1e} |")


if __name__ == "__main__":
    main()
