"""Triton gate_up GEMM with the folded pre-MLP RMSNorm and SiLU-and-mul in its epilogue, for decode-size M
(up to GATE_UP_SILU_MAX_ROWS rows): the fused forward's MLP input, one launch where the GEMM route takes a
cuBLAS GEMM and kernels/activation.py's SiLU-and-mul.

out (M, I) = silu(s * (x Wg^T)) * (s * (x Wu^T)), where W (2I, K) = [Wg | Wu] stacked by rows (the loader's
gate_up_proj, norm weight folded in: server/model/norm_folding.py) and s = rsqrt(mean(x^2) + eps) per row of
the un-normed residual stream x (M, K). Grid (I / BLOCK_N, M / BLOCK_M): each program holds a gate and an
up accumulator for the same BLOCK_N intermediate columns and walks all of K, so it also sums its rows'
squares as the x tiles pass (the row scale costs no extra read and no extra launch): as the diagonal of a
third product, x x^T, so that x feeds tensor-core dots alone. Summed from the x tile in registers instead, it
gave 0.1-0.5 relative errors at BLOCK_M 64 on an H100 (Triton 3.6.0): the pipeliner then keeps x in one
buffer fewer than the weights (2 against 3 stages) while the asynchronous wgmma still reads it, and the
load two steps ahead overwrites the tile in use (tools/gate_up_silu_probe; the TTGIR shows the buffers).
The extra dot costs BLOCK_M / (2 BLOCK_N) more tensor-core work in a memory-bound loop. The products are
rounded to the model dtype before the scale, where the unfused path's GEMM output is rounded, then scaled,
activated and multiplied in fp32 and rounded once, as kernels/activation.py does.

Why (H200, bench preset, 64 rows): the separate SiLU-and-mul kernel costs ~2.2 us a layer plus a launch gap,
and the (M, 2I) product makes a round trip through memory; the GEMM itself runs at cuBLAS's speed for this
shape at 16-64 rows (tools/splitk_gemm_probe: 19.30 against 19.44 us at 64 rows, one K split). Above that
cuBLAS's tiles win (46.7 against 26.3 us at 256 rows), hence the row limit. Torch reference:
kernels.fused_reference.gate_up_silu_reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GATE_UP_SILU_MAX_ROWS = 64  # up to here the fused launch replaces cuBLAS's GEMM + the SiLU-and-mul kernel


class Tiles(NamedTuple):
    """One launch's configuration: rows, intermediate columns (each a gate and an up column), K step."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int  # for 2-byte dtypes; fp32 takes half (its tiles are twice the shared memory)
    num_warps: int


# (the most rows, tiles), in increasing rows. BLOCK_N 64 reads 128 weight rows a K step, the tile that
# tools/splitk_gemm_probe found best for the plain gate_up GEMM at 16 and 64 rows (BN 128, BK 128).
# tools/gate_up_silu_bench --sweep (H100): 25.97 us a layer at 16 rows, 26.45 at 64; 32-row tiles
# (mma.sync, not wgmma) took 31.3 at 32 rows, so 17-64 rows take the 64-row tile.
TILE_CLASSES = (
    (16, Tiles(16, 64, 128, 3, 4)),
    (GATE_UP_SILU_MAX_ROWS, Tiles(64, 64, 128, 3, 4)),
)


@triton.jit
def _gate_up_silu_kernel(X, W, OUT, eps, M, K, stride_x, stride_o,
                         INTERMEDIATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """OUT (M, I) tile (pid_m, pid_n) = silu(s * X Wg^T) * (s * X Wu^T). EVEN: I % BLOCK_N == 0 and
    K % BLOCK_K == 0, so that the weight loads need no mask. DOT_PRECISION "ieee" for fp32 operands."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                     # (BN,) intermediate columns
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                     # (BM,) rows
    rk = tl.arange(0, BLOCK_K)                                       # (BK,) this step's K columns
    m_ok, n_ok = rm < M, rn < INTERMEDIATE
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    g_ptrs = W + rn[:, None].to(tl.int64) * K + rk[None, :]          # gate rows; up rows start I rows on
    up_offset = INTERMEDIATE * K
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gram = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)            # x x^T: its diagonal, the rows' squares
    for k in range(0, K, BLOCK_K):
        if EVEN:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(g_ptrs + up_offset)
        else:
            k_ok = rk + k < K
            w_mask = n_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=w_mask, other=0.0)
            u = tl.load(g_ptrs + up_offset, mask=w_mask, other=0.0)
        acc_g = tl.dot(x, tl.trans(g), acc_g, input_precision=DOT_PRECISION)  # (BM, BN) fp32
        acc_u = tl.dot(x, tl.trans(u), acc_u, input_precision=DOT_PRECISION)
        gram = tl.dot(x, tl.trans(x), gram, input_precision=DOT_PRECISION)   # (BM, BM) fp32
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    rb = tl.arange(0, BLOCK_M)
    squares = tl.sum(tl.where(rb[:, None] == rb[None, :], gram, 0.0), axis=1)  # (BM,) sum of x^2 per row
    rstd = tl.rsqrt(squares / K + eps)[:, None]                      # (BM, 1)
    gate = acc_g.to(OUT.dtype.element_ty).to(tl.float32) * rstd      # rounded where the GEMM output is
    up = acc_u.to(OUT.dtype.element_ty).to(tl.float32) * rstd
    y = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = OUT + rm[:, None].to(tl.int64) * stride_o + rn[None, :]
    tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_kernel = CachedLauncher(_gate_up_silu_kernel, num_tensors=3)


def tile_config(rows: int) -> Tiles:
    """The launch configuration for `rows` (<= GATE_UP_SILU_MAX_ROWS) rows."""
    return next(tiles for most, tiles in TILE_CLASSES if rows <= most)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (M, K) un-normed rows, weight (2I, K) = [gate | up] with the norm's weight folded in -> (M, I):
    silu(s * x Wg^T) * (s * x Wu^T), s = rsqrt(mean(x^2) + eps) per row (M <= GATE_UP_SILU_MAX_ROWS; x's
    rows contiguous, weight contiguous, one dtype)."""
    m, k = x.shape
    if weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be (2I, {k}), got {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"gate_up_silu takes one dtype of {DTYPES}, got {x.dtype}, {weight.dtype}")
    if m > GATE_UP_SILU_MAX_ROWS:
        raise ValueError(f"gate_up_silu serves up to {GATE_UP_SILU_MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("gate_up_silu needs rows of x contiguous and a contiguous weight")
    inter = weight.shape[0] // 2
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    t = tile_config(m)
    grid = (triton.cdiv(inter, t.block_n), triton.cdiv(m, t.block_m))
    _kernel(grid, x, weight, out, float(eps), m, k, x.stride(0), out.stride(0),
            INTERMEDIATE=inter, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
            EVEN=inter % t.block_n == 0 and k % t.block_k == 0,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=t.num_warps,
            num_stages=t.num_stages if x.element_size() <= 2 else max(1, t.num_stages // 2))
    return out
