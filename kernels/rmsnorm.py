"""Triton RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder.

One program per row: load the row (and its residual), add, store the sum back into the residual (the
residual stream keeps its dtype, as the unfused `x + h` does), reduce the mean square in fp32, scale by the
weight and round once. The add and the norm then read the hidden row once instead of three times.
Torch reference: kernels.fused_reference.rms_norm_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(
    X, RESIDUAL, WEIGHT, OUT, eps,
    stride_x, stride_r, stride_o,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)                                          # (BLOCK,)
    mask = offs < HIDDEN
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        # phase 1: the residual stream advances in its own dtype; the norm reads the rounded sum
        res_ptrs = RESIDUAL + row * stride_r + offs
        total = (x + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(RESIDUAL.dtype.element_ty)
        tl.store(res_ptrs, total, mask=mask)
        x = total.to(tl.float32)
    # phase 2: mean square in fp32 (masked lanes are 0), scale, round once
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    w = tl.load(WEIGHT + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + offs, (x * rstd * w).to(OUT.dtype.element_ty), mask=mask)


_norm = CachedLauncher(_rms_norm_kernel, num_tensors=4)


def _launch(x, residual, weight, out, eps):
    """Grid (T,): the whole row is one tile (a hidden size of a few thousand fits in registers); one warp
    per 256 elements keeps each thread at about eight values."""
    t, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    warps = min(16, max(1, block // 256))
    add = residual is not None
    res = residual if add else x
    _norm((t,), x, res, weight, out, eps, x.stride(0), res.stride(0), out.stride(0),
          HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=add, num_warps=warps, num_stages=1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, H) -> rms_norm(x) * weight (T, H) in x's dtype.

    residual (T, H): residual <- residual + x in place first, and the sum is normed (the pre-norm decoder's
    add of a sublayer output to the stream, then the next sublayer's norm).
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be (T, H) with contiguous rows, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in DTYPES:
        raise ValueError(f"rms_norm supports {DTYPES}, got {x.dtype}")
    if weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous ({x.shape[1]},) tensor, got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} with contiguous rows")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _launch(x, residual, weight, out, float(eps))
    return out


# ---- the folded norms' row scale, applied after a GEMM (server/model/norm_folding.py) ------------------


@triton.jit
def row_rstd(ROW, eps, HIDDEN: tl.constexpr, H_BLOCK: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of the HIDDEN values at ROW, in fp32: the RMSNorm scale of one row."""
    offs = tl.arange(0, H_BLOCK)
    x = tl.load(ROW + offs, mask=offs < HIDDEN, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)


def check_row_extras(x: torch.Tensor, norm_of: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """ValueError unless norm_of is (T, H) with contiguous rows and bias (x's width,) contiguous, both in
    x's dtype and on its device: the folded norm's row and the projection's bias that a kernel applies to the
    projection x (T, N) (the checks of kernels.rope_store.rope_store_kv and
    kernels.activation.silu_and_mul)."""
    if norm_of is not None and (norm_of.dim() != 2 or norm_of.shape[0] != x.shape[0]
                                or norm_of.stride(-1) != 1 or norm_of.dtype != x.dtype
                                or norm_of.device != x.device):
        raise ValueError(f"norm_of must be ({x.shape[0]}, H) {x.dtype} with contiguous rows on {x.device}, "
                         f"got {tuple(norm_of.shape)} {norm_of.dtype} strides {norm_of.stride()}")
    if bias is not None and (bias.shape != (x.shape[1],) or not bias.is_contiguous()
                             or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be a contiguous ({x.shape[1]},) {x.dtype} tensor on {x.device}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
