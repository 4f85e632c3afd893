"""Triton SiLU-and-mul: the SwiGLU activation silu(gate) * up on the fused gate_up projection's output.

gate_up (T, 2I) holds [gate | up] per row (the loader stacks the two matrices); one pass reads both halves
and writes the (T, I) product, in fp32 and rounded once, where the unfused path makes two passes and a
temporary. Torch reference: kernels.fused_reference.silu_and_mul_reference.

With `norm_of` the pre-MLP RMSNorm happens here, after the GEMM (the fused forward's folded norms,
server/model/norm_folding.py; the scale: kernels.rmsnorm.row_rstd): gate_up is then the projection of the
un-normed residual row r by weights that hold the norm's weight, and each row is first scaled by
rsqrt(mean(r^2) + eps) (a per-row scalar commutes with the GEMM), then gains the projection's bias. This
saves the norm's own launch. The row's mean square is reduced by each of the row's programs: at decode sizes
a few per row (r comes from L2 after the first); from NORM_ROW_PROGRAM_TOKENS rows on, one program per row
walks all its columns, since there a re-read per 1024 columns cost a prefill step of 16 x 512 tokens 1.0 ms
more in its SiLU kernels (H200, bench preset).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher
from kernels.rmsnorm import check_row_extras, row_rstd

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 1024  # elements of one row per tile: a tile per program keeps every SM busy at batch 1
NORM_ROW_PROGRAM_TOKENS = 1024  # with norm_of, from this many rows on a program walks its row's every tile


@triton.jit
def _silu_and_mul_kernel(
    GATE_UP, OUT, RESIDUAL, BIAS, eps, stride_in, stride_out, stride_r,
    INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
    NORM: tl.constexpr, HIDDEN: tl.constexpr, H_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Program (row, c) writes tiles c * TILES ... (c + 1) * TILES - 1 of the row's BLOCK-wide tiles."""
    row = tl.program_id(0).to(tl.int64)
    rstd = 1.0
    if NORM:  # the folded pre-MLP norm: scale the projection of the un-normed row
        rstd = row_rstd(RESIDUAL + row * stride_r, eps, HIDDEN, H_BLOCK)
    for tile in range(TILES):
        offs = (tl.program_id(1) * TILES + tile) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) columns
        mask = offs < INTERMEDIATE
        src = GATE_UP + row * stride_in + offs
        gate = tl.load(src, mask=mask, other=0.0).to(tl.float32) * rstd
        up = tl.load(src + INTERMEDIATE, mask=mask, other=0.0).to(tl.float32) * rstd
        if HAS_BIAS:
            gate += tl.load(BIAS + offs, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(BIAS + INTERMEDIATE + offs, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(OUT + row * stride_out + offs, y.to(OUT.dtype.element_ty), mask=mask)


_silu_mul = CachedLauncher(_silu_and_mul_kernel, num_tensors=4)


def _launch(gate_up, out, norm_of, eps, bias):
    """Grid (T, cdiv(I, block * tiles)); 4 warps give each thread 8 values of a 1024-wide block."""
    t, inter = out.shape
    block = min(BLOCK, triton.next_power_of_2(inter))
    tiles = triton.cdiv(inter, block) if norm_of is not None and t >= NORM_ROW_PROGRAM_TOKENS else 1
    res = gate_up if norm_of is None else norm_of                       # unread without NORM
    _silu_mul((t, triton.cdiv(inter, block * tiles)), gate_up, out, res, gate_up if bias is None else bias,
              float(eps), gate_up.stride(0), out.stride(0), res.stride(0),
              INTERMEDIATE=inter, BLOCK=block, TILES=tiles, NORM=norm_of is not None, HIDDEN=res.shape[1],
              H_BLOCK=triton.next_power_of_2(res.shape[1]), HAS_BIAS=bias is not None,
              num_warps=4, num_stages=1)


def silu_and_mul(gate_up: torch.Tensor, *, norm_of: torch.Tensor | None = None, eps: float = 0.0,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up (T, 2I) = [gate | up] -> silu(gate) * up (T, I) in gate_up's dtype.

    norm_of (T, H): each row of gate_up is first scaled by rsqrt(mean(norm_of_row^2) + eps); bias (2I,): then
    added (the gate_up projection's own, left out of its GEMM)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be (T, 2I) with contiguous rows, got shape {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"silu_and_mul supports {DTYPES}, got {gate_up.dtype}")
    check_row_extras(gate_up, norm_of, bias)
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        _launch(gate_up, out, norm_of, eps, bias)
    return out

