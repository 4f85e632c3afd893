"""Triton SiLU-and-mul: the SwiGLU activation silu(gate) * up on the fused gate_up projection's output.

gate_up (T, 2I) holds [gate | up] per row (the loader stacks the two matrices); one pass reads both halves
and writes the (T, I) product, in fp32 and rounded once, where the unfused path makes two passes and a
temporary. Torch reference: kernels.fused_reference.silu_and_mul_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 1024  # elements of one row per program: a few programs per row keep every SM busy at batch 1


@triton.jit
def _silu_and_mul_kernel(
    GATE_UP, OUT, stride_in, stride_out,
    INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)               # (BLOCK,) columns of the row
    mask = offs < INTERMEDIATE
    src = GATE_UP + row * stride_in + offs
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + INTERMEDIATE, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(OUT + row * stride_out + offs, y.to(OUT.dtype.element_ty), mask=mask)


_silu_mul = CachedLauncher(_silu_and_mul_kernel, num_tensors=2)


def _launch(gate_up, out):
    """Grid (T, cdiv(I, block)); 4 warps give each thread 8 values of a 1024-wide block."""
    t, inter = out.shape
    block = min(BLOCK, triton.next_power_of_2(inter))
    _silu_mul((t, triton.cdiv(inter, block)), gate_up, out, gate_up.stride(0), out.stride(0),
              INTERMEDIATE=inter, BLOCK=block, num_warps=4, num_stages=1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) = [gate | up] -> silu(gate) * up (T, I) in gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be (T, 2I) with contiguous rows, got shape {tuple(gate_up.shape)} "
                         f"strides {gate_up.stride()}")
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"silu_and_mul supports {DTYPES}, got {gate_up.dtype}")
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        _launch(gate_up, out)
    return out
