"""Triton GEMM with the SwiGLU activation as its epilogue: the gate_up projection of a decode step's few rows.

act = silu(gate) * up for gate = x Wg^T, up = x Wu^T, x (M, K), W = [Wg | Wu] (2I, K) as the loader stacks
the gate_up projection: one launch and no (M, 2I) temporary, where the GEMM route runs a cuBLAS GEMM and
then kernels/activation.py's SiLU-and-mul. A program owns BLOCK_N columns of the gate and the same columns
of the up half, two accumulators fed by one x tile, so the activation needs nothing from another program.

With `norm` the folded pre-MLP RMSNorm happens here (server/model/norm_folding.py): x is the un-normed
residual stream, W holds the norm's weight, and each row of both products is scaled by
rsqrt(mean(x^2) + eps). The program has every x tile of its rows in registers for the dot anyway, so it sums
their squares on the way: the norm costs no extra read. Rounding is silu_and_mul's on a cuBLAS output: each
product is rounded to the model dtype (as the GEMM's output is), then scaled, biased, activated in fp32 and
rounded once.

It serves the multi-row decode steps up to MAX_ROWS rows, where one BLOCK_M tile covers the batch and the
weights are read once; cuBLAS keeps the larger batches and prefill (tools/gated_gemm_probe.py times both
routes per row count; docs/benchmarks/decode_forward_h200.md has the measurement).
Torch reference: kernels.fused_reference.gated_gemm_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 64  # the largest batch the fused forward gives this kernel (one row tile: weights read once)
BLOCK_M = 64   # the largest row tile
BLOCK_N = 64   # gate columns a program (and as many up columns): 128 programs for the bench's I = 8192
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4


@triton.jit
def _gated_gemm_kernel(
    X, W, OUT, BIAS, M, eps, stride_x, stride_out,
    K: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (n, m) writes OUT[m tile, n tile]: gate columns rn of W's first INTER rows, up columns rn of
    the INTER rows after them."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)             # (BLOCK_M,) rows of x
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)             # (BLOCK_N,) gate (and up) columns
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < INTER
    x_ptrs = X + rm.to(tl.int64)[:, None] * stride_x + rk[None, :]       # (BLOCK_M, BLOCK_K)
    g_ptrs = W + rn.to(tl.int64)[:, None] * K + rk[None, :]              # (BLOCK_N, BLOCK_K)
    u_ptrs = g_ptrs + INTER * K
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
        acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PRECISION)
        if NORM:
            xf = x.to(tl.float32)
            sum_sq += tl.sum(xf * xf, axis=1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = OUT.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)                                # rounded as the GEMM output is
    up = acc_u.to(dtype).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(sum_sq / K + eps)[:, None]                       # (BLOCK_M, 1)
        gate *= rstd
        up *= rstd
    if HAS_BIAS:
        gate += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(BIAS + INTER + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = OUT + rm.to(tl.int64)[:, None] * stride_out + rn[None, :]
    tl.store(out_ptrs, y.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


_gated_gemm = CachedLauncher(_gated_gemm_kernel, num_tensors=4)


def _launch(x, weight, out, bias, norm, eps):
    """Grid (cdiv(I, BLOCK_N), cdiv(M, BLOCK_M)): BLOCK_M the rows padded to a tensor-core tile (16..64);
    4 stages of (x + 2 weight tiles) = 48 KB each at the bench shape, in the H200's 228 KB of shared
    memory."""
    m, k = x.shape
    inter = out.shape[1]
    block_m = min(BLOCK_M, max(16, triton.next_power_of_2(m)))
    block_n = min(BLOCK_N, max(16, triton.next_power_of_2(inter)))
    block_k = min(BLOCK_K, max(16, triton.next_power_of_2(k)))
    _gated_gemm((triton.cdiv(inter, block_n), triton.cdiv(m, block_m)), x, weight, out,
                x if bias is None else bias, m, float(eps), x.stride(0), out.stride(0),
                K=k, INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm,
                HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _new_output(m: int, inter: int, x: torch.Tensor) -> torch.Tensor:
    """The (M, I) activation (uninitialised: every element is written; tests poison it through here)."""
    return torch.empty(m, inter, dtype=x.dtype, device=x.device)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """-> I, the activation's width; ValueError on any input the kernel does not take."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be (M, K) with contiguous rows, got shape {tuple(x.shape)} strides "
                         f"{x.stride()}")
    if x.dtype not in DTYPES:
        raise ValueError(f"gated_gemm supports {DTYPES}, got {x.dtype}")
    k = x.shape[1]
    if (weight.dim() != 2 or weight.shape[1] != k or weight.shape[0] % 2 or not weight.is_contiguous()
            or weight.dtype != x.dtype or weight.device != x.device):
        raise ValueError(f"weight must be contiguous [gate | up] (2I, {k}) {x.dtype} on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or not bias.is_contiguous()
                             or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be contiguous ({weight.shape[0]},) {x.dtype} on {x.device}, got "
                         f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")
    return weight.shape[0] // 2


def gated_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               norm: bool = False, eps: float = 0.0) -> torch.Tensor:
    """x (M, K), weight [gate | up] (2I, K) -> silu(gate) * up (M, I) in x's dtype, where
    [gate | up] = x @ weight.T, each row scaled by rsqrt(mean(x_row^2) + eps) if norm, then + bias (2I,):
    what silu_and_mul(F.linear(x, weight), norm_of=x if norm else None, eps=eps, bias=bias) computes."""
    inter = _check(x, weight, bias)
    out = _new_output(x.shape[0], inter, x)
    if x.shape[0]:
        _launch(x, weight, out, bias, norm, eps)
    return out
