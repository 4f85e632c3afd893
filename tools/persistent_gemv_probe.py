"""Probe (GPU, not a test) for issue 16: can one persistent Triton kernel run a chain of decode-sized GEMVs
faster than one launch each? A chain of L bf16 GEMVs y_l = W_l x_l, x_{l+1} = y_l (N = K = 2048, 8 MiB of
weights a layer, 16 layers = 128 MiB: streamed from HBM, not L2), batch 1:
- cuBLAS (F.linear) per layer, captured in one CUDA graph (today's decode forward: ~6 us a small GEMM);
- the same Triton GEMV launched per layer, in one CUDA graph;
- one persistent launch of #SM programs that walks the layers with a grid barrier (atomic counter + spin)
  between them, with and without loading the next layer's first weight tile before waiting.
Prints us per layer, achieved TB/s and the copy bandwidth measured in the same run; JSON to $OUT.
`python -m tools.persistent_gemv_probe` (GPU) or `TRITON_INTERPRET=1 ... --cpu-check` (one program).
One run: docs/benchmarks/persistent_gemv_h200.json.
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from tools.kernel_bench import graph_us


@triton.jit
def _gemv_rows(w_ptr, x_ptr, y_ptr, nb, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[nb*BN:(nb+1)*BN] = W[rows] @ x, fp32 accumulate; x read from L2 (.cg: other programs wrote it)."""
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :])
        x = tl.load(x_ptr + k0 + rk, cache_modifier=".cg")
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _gemv_one(w_ptr, x_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _gemv_rows(w_ptr, x_ptr, y_ptr, tl.program_id(0), K, BLOCK_N, BLOCK_K)


@triton.jit
def _gemv_chain(w_ptr, buf_ptr, sync_ptr, num_layers, N, K, NUM_PROGS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """Persistent: program p takes row blocks p, p + P, ... of every layer; after each layer all programs
    meet at a barrier (one counter, incremented with release, polled with acquire). buf: (2, N) ping-pong."""
    pid = tl.program_id(0)
    nblocks = N // BLOCK_N
    for layer in range(num_layers):
        w = w_ptr + layer * N * K                           # (int32: 16 x 2048 x 2048 fits)
        x = buf_ptr + (layer % 2) * N
        y = buf_ptr + ((layer + 1) % 2) * N
        for nb in range(pid, nblocks, NUM_PROGS):
            _gemv_rows(w, x, y, nb, K, BLOCK_N, BLOCK_K)
        if PREFETCH:  # touch the next layer's first tile of this program's rows: its HBM read starts now
            if layer + 1 < num_layers:
                nxt = w_ptr + (layer + 1) * N * K
                rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
                rk = tl.arange(0, BLOCK_K)
                tl.load(nxt + rn[:, None] * K + rk[None, :], eviction_policy="evict_last")
        tl.debug_barrier()                                   # this program's stores are issued
        tl.atomic_add(sync_ptr, 1, sem="release")
        target = (layer + 1) * NUM_PROGS
        while tl.atomic_add(sync_ptr, 0, sem="acquire") < target:
            pass


def chain_reference(ws, x):
    for w in ws:
        x = (w.float() @ x.float()).to(x.dtype)
    return x


def cpu_check():
    torch.manual_seed(0)
    L, N = 3, 64
    ws = torch.randn(L, N, N) / 8
    x0 = torch.randn(N)
    buf = torch.zeros(2, N)
    buf[0] = x0
    sync = torch.zeros(1, dtype=torch.int32)
    _gemv_chain[(1,)](ws, buf, sync, L, N, N, NUM_PROGS=1, BLOCK_N=16, BLOCK_K=32, PREFETCH=True)
    ref = chain_reference(ws, x0)
    print("persistent max err", (buf[L % 2] - ref).abs().max().item())
    y = torch.zeros(N)
    _gemv_one[(N // 16,)](ws[0], x0, y, N, N, BLOCK_N=16, BLOCK_K=32)
    print("one-layer max err", (y - ws[0] @ x0).abs().max().item())


def gpu_main():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    L, N = 16, 2048
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = (torch.randn(L, N, N, device=dev) / 45).to(dt)
    x0 = torch.randn(N, device=dev, dtype=dt)
    ref = chain_reference(ws, x0)
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_us = graph_us(lambda: dst.copy_(src), reps=20)
    copy_tbps = 2 * src.numel() / copy_us / 1e6
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "layers": L, "n": N, "copy_TBps": copy_tbps, "rows": []}
    bytes_layer = N * N * 2

    def report(name, us, out):
        err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        row = {"name": name, "us_per_layer": us / L, "TBps": bytes_layer * L / us / 1e6, "rel_err": err}
        res["rows"].append(row)
        print(f"{name:44s} {us / L:7.2f} us/layer {row['TBps']:5.2f} TB/s  err {err:.1e}", flush=True)

    bufs = [torch.empty(N, device=dev, dtype=dt) for _ in range(L + 1)]
    bufs[0].copy_(x0)

    def cublas():
        for i in range(L):
            torch.nn.functional.linear(bufs[i][None], ws[i], out=bufs[i + 1][None])
    report("cuBLAS F.linear per layer (graph)", graph_us(cublas, reps=20), (cublas(), bufs[L])[1])
    for bn, bk, warps in ((16, 256, 4), (32, 256, 4), (8, 512, 4)):
        def one(bn=bn, bk=bk, warps=warps):
            for i in range(L):
                _gemv_one[(N // bn,)](ws[i], bufs[i], bufs[i + 1], N, N, BLOCK_N=bn, BLOCK_K=bk,
                                      num_warps=warps)
        report(f"Triton GEMV per layer bn{bn} bk{bk} (graph)", graph_us(one, reps=20), (one(), bufs[L])[1])
    buf = torch.empty(2, N, device=dev, dtype=dt)
    sync = torch.zeros(1, dtype=torch.int32, device=dev)
    for progs in (sms, 2 * sms):
        for bn, bk in ((8, 512), (16, 256)):
            for prefetch in (False, True):
                def chain(progs=progs, bn=bn, bk=bk, prefetch=prefetch):
                    buf[0].copy_(x0)
                    sync.zero_()
                    _gemv_chain[(progs,)](ws, buf, sync, L, N, N, NUM_PROGS=progs, BLOCK_N=bn, BLOCK_K=bk,
                                          PREFETCH=prefetch, num_warps=4)
                try:
                    us = graph_us(chain, reps=20)
                    report(f"persistent {progs} progs bn{bn} bk{bk} prefetch={prefetch}", us,
                           (chain(), torch.cuda.synchronize(), buf[L % 2])[2])
                except Exception as e:  # noqa: BLE001
                    print(f"persistent {progs} bn{bn} {type(e).__name__}: {str(e)[:160]}", flush=True)
    print(f"copy bandwidth {copy_tbps:.2f} TB/s; bytes per layer {bytes_layer / 1e6:.1f} MB "
          f"(ideal {bytes_layer / copy_tbps / 1e6:.2f} us/layer)")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "megakernel_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    cpu_check() if "--cpu-check" in sys.argv else gpu_main()
