"""Triton split-K GEMM that adds into the residual stream: residual (M, N) += x (M, K) W (N, K)^T in place,
for decode-size M (up to SPLITK_MAX_ROWS rows): the fused forward's down projection.

Why: at 16-64 rows the down projection (the bench shape: N = hidden 2048, K = intermediate 8192) has too
few output tiles to fill the GPU, so cuBLAS splits K and sums the splits in a second kernel (nvjet splitK +
cublasLt splitKreduce: 11.7 + 2.3 us a layer at 64 rows on an H200, docs/benchmarks/decode_forward_h200.md).
Here grid (N / BLOCK_N, SPLIT_K, M / BLOCK_M): each program multiplies one K range of one column tile and
writes its fp32 partial; the program that draws the last ticket of its tile sums the partials in split
order (the same bits whichever program finished last), adds the residual and rounds once, as cuBLAS's
beta = 1 does. tools/splitk_gemm_probe timed this scheme on the H200 (16 layers' distinct weights in one
CUDA graph, docs/benchmarks/splitk_gemm_h200.json): 13.3 us at 64 rows (BLOCK_N 64, cuBLAS 13.5) and 11.7
at 16 (BLOCK_N 32, cuBLAS 13.1); at 256 rows cuBLAS is faster (21.6 against 25.1), hence the row limit.

Tickets: one int32 counter per (row tile, column tile), zeroed once when the device's counters are made
and set back to zero by the tile's merging program, so a launch leaves them all zero (as the decode
attention's DecodeWorkspace). Launches on one stream run in order and share them; they are made outside
any CUDA-graph capture (`warm_up`, or the first eager call). Torch reference:
kernels.fused_reference.splitk_add_reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SPLITK_MAX_ROWS = 64  # up to here this kernel beats cuBLAS's split-K + reduce on the down projection
MAX_TILES = 4096      # (row tile, column tile) counters a device holds: N / 32 x 4 row tiles up to N = 32768


class Tiles(NamedTuple):
    """One launch's configuration: the output tile, the K step, the K splits, pipeline stages, warps."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_stages: int  # for 2-byte dtypes; fp32 takes half (4 stages of 64 x 64 x 128 fp32 tiles need 256 KiB)
    num_warps: int


# tools/splitk_add_bench --sweep's best on the H200 at the bench shape (docs/benchmarks/splitk_add_h200.json:
# 36 configurations at 16, 32 and 64 rows): K ranges of 2048 at K = 8192, 4 stages, 4 warps; the tile
# grows with the rows. (the most rows, tiles), in increasing rows.
TILE_CLASSES = (
    (16, Tiles(16, 32, 128, 4, 4, 4)),               # 11.9 us a layer at 16 rows (cuBLAS addmm_ 14.0)
    (32, Tiles(32, 32, 128, 4, 4, 4)),               # 12.7 at 32 (64-row tiles 13.7, cuBLAS 14.3)
    (SPLITK_MAX_ROWS, Tiles(64, 64, 128, 4, 4, 4)),  # 13.8 at 64 (cuBLAS 14.6)
)


@triton.jit
def _splitk_add_kernel(X, W, RES, PART, TICKETS, M, N, K, stride_x, stride_r, k_per_split,
                       SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """RES (M, N) += X (M, K) W (N, K)^T for the program's (BLOCK_M, BLOCK_N) tile and K range
    [pid_k * k_per_split, + k_per_split) (a multiple of BLOCK_K). EVEN: N % BLOCK_N == 0 and
    K == SPLIT_K * k_per_split, so that the weight loads need no mask. PART: (SPLIT_K, M_PAD, N) fp32.
    DOT_PRECISION "ieee" for fp32 operands (as torch's fp32 matmul, no TF32), else "tf32" (unused)."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                    # (BN,) output columns
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                    # (BM,) rows
    rk = pid_k * k_per_split + tl.arange(0, BLOCK_K)                # (BK,) this step's K columns
    m_ok, n_ok = rm < M, rn < N
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_ptrs = W + rn[:, None].to(tl.int64) * K + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = rk + k < K                                       # (a split's range ends in K)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)  # (BM, BN) fp32
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    res_ptrs = RES + rm[:, None].to(tl.int64) * stride_r + rn[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        total = acc + tl.load(res_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(res_ptrs, total.to(RES.dtype.element_ty), mask=out_mask)
    else:
        m_pad = tl.num_programs(2) * BLOCK_M
        part = PART + rm[:, None].to(tl.int64) * N + rn[None, :]   # split 0's partial of this tile
        tl.store(part + pid_k * m_pad * N, acc, mask=n_ok[None, :])
        # every thread's partial is stored (barrier) before the ticket's release; the acquire of the last
        # ticket orders the merge's loads after every other split's release
        tl.debug_barrier()
        counter = TICKETS + pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.load(res_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            for s in tl.static_range(SPLIT_K):                      # split order: deterministic
                total += tl.load(part + s * m_pad * N, mask=n_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.store(res_ptrs, total.to(RES.dtype.element_ty), mask=out_mask)
            tl.store(counter, 0)                                    # back to zero for the next launch


_kernel = CachedLauncher(_splitk_add_kernel, num_tensors=5)
_tickets: dict[torch.device, torch.Tensor] = {}


def tile_config(rows: int) -> Tiles:
    """The launch configuration for `rows` (<= SPLITK_MAX_ROWS) rows."""
    return next(tiles for most, tiles in TILE_CLASSES if rows <= most)


def warm_up(device: torch.device) -> None:
    """Makes `device`'s zeroed ticket counters (before a CUDA-graph capture uses them)."""
    device = torch.device(device)
    if device not in _tickets:
        _tickets[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def _device_tickets(device: torch.device) -> torch.Tensor:
    if device not in _tickets:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("splitk_add's counters are made outside CUDA-graph capture: call "
                               "kernels.splitk_add.warm_up(device) first")
        warm_up(device)
    return _tickets[device]


def splitk_add(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """residual (M, N) += x (M, K) weight (N, K)^T in place, summed in fp32 and rounded once (M <=
    SPLITK_MAX_ROWS; x and residual rows contiguous, weight contiguous, one dtype)."""
    m, k = x.shape
    n = weight.shape[0]
    if residual.shape != (m, n) or weight.shape[1] != k:
        raise ValueError(f"shapes do not chain: residual {tuple(residual.shape)}, x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if not (x.dtype == weight.dtype == residual.dtype) or x.dtype not in DTYPES:
        raise ValueError(f"splitk_add takes one dtype of {DTYPES}, got {x.dtype}, {weight.dtype}, "
                         f"{residual.dtype}")
    if m > SPLITK_MAX_ROWS:
        raise ValueError(f"splitk_add serves up to {SPLITK_MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or residual.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("splitk_add needs rows of x and residual contiguous and a contiguous weight")
    if m == 0:
        return
    t = tile_config(m)
    k_per_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k) * t.block_k
    grid = (triton.cdiv(n, t.block_n), t.split_k, triton.cdiv(m, t.block_m))
    tickets = _device_tickets(x.device)
    if grid[0] * grid[2] > tickets.numel():
        raise ValueError(f"splitk_add holds {tickets.numel()} tile counters, {grid[0] * grid[2]} needed")
    part = torch.empty(t.split_k * grid[2] * t.block_m * n, dtype=torch.float32, device=x.device)
    even = n % t.block_n == 0 and k == t.split_k * k_per_split
    _kernel(grid, x, weight, residual, part, tickets, m, n, k, x.stride(0), residual.stride(0), k_per_split,
            SPLIT_K=t.split_k, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN=even,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=t.num_warps,
            num_stages=t.num_stages if x.element_size() <= 2 else max(1, t.num_stages // 2))
