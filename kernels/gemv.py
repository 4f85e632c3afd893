"""Triton GEMV for one token row (the batch-1 decode step), with the memory-bound ops around it fused in.

y = W x for x (1, K), W (N, K) as nn.Linear stores it, plus, chosen per call:
- a norm prologue: x <- rms_norm(x) * norm_weight, rounded to x's dtype as kernels/rmsnorm.py rounds it
  (every program norms the whole row itself: K values read from L2, cheaper than a launch);
- a gated epilogue: W stacks [gate | up] (2N, K) and the output is silu(gate x) * (up x) (N,), each half
  rounded to the model dtype first as the unfused GEMM's output is;
- a residual epilogue: residual <- residual + y in place (the pre-norm decoder's `x = x + sublayer(x)`,
  rounded as there), each output element read and written by the one program that owns its row.

Why a hand-written GEMV: at batch 1 a decode layer's four projections are cuBLAS GEMMs of ~3-19 us each plus
a split-K reduce, and the norms and activation are launches of their own. One program holds a tile of
BLOCK_N whole weight rows (TILE elements) in registers: loaded in one go, before its input is known, so that
with programmatic dependent launch (Hopper) the next kernel's weight reads start while this one finishes.
Measured on an H200 (torch 2.11, Triton 3.6; .tools/gemv_pdl_probe.py, the bench shape's 64 projections of
a 16-layer step, 1.95 GB, chained in one CUDA graph): cuBLAS 688.6 us; this kernel 564.1 us plain, 550.0
with PDL waiting first, 528.8 with the tile loaded before the wait (8192-element tiles; 16384: 532.0,
32768: 550.5). At 8 rows the same kernel takes 1,571 us against cuBLAS's 693, so it serves one row only.
Torch reference: kernels.fused_reference.gemv_reference.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE = 8192  # weight elements a program holds (per half when gated): the probe's fastest tile


@triton.jit
def _gemv_kernel(
    W, X, OUT, RESIDUAL, NORM_W, BIAS, N, eps,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    NORM: tl.constexpr, GATED: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)              # (BLOCK_N,) output rows
    rk = tl.arange(0, K_PAD)                                             # (K_PAD,) the whole reduction
    n_mask = rn < N
    k_mask = rk < K
    w_mask = n_mask[:, None] & k_mask[None, :]
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch: it waits for our writes itself
    # phase 1: the weights, which no earlier kernel writes: their reads start before the wait
    w_ptrs = W + rn.to(tl.int64)[:, None] * K + rk[None, :]
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)                          # (BLOCK_N, K_PAD)
    if GATED:
        u = tl.load(w_ptrs + N * K, mask=w_mask, other=0.0)              # the up rows, N rows below
    if USE_GDC:
        tl.extra.cuda.gdc_wait()               # the kernel before us has finished and its writes are visible
    # phase 2: the input row, normed here if asked
    x = tl.load(X + rk, mask=k_mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        g = tl.load(NORM_W + rk, mask=k_mask, other=0.0).to(tl.float32)
        x = (x * rstd * g).to(X.dtype.element_ty).to(tl.float32)
    # phase 3: the dot in fp32, rounded to the model dtype as the GEMM's output is, then the epilogue
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)                    # (BLOCK_N,)
    if HAS_BIAS:
        y += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)
    y = y.to(OUT.dtype.element_ty).to(tl.float32)
    if GATED:
        up = tl.sum(u.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            up += tl.load(BIAS + N + rn, mask=n_mask, other=0.0).to(tl.float32)
        up = up.to(OUT.dtype.element_ty).to(tl.float32)
        y = y / (1.0 + tl.exp(-y)) * up
    if ADD:
        y += tl.load(RESIDUAL + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(OUT + rn, y.to(OUT.dtype.element_ty), mask=n_mask)


_gemv = CachedLauncher(_gemv_kernel, num_tensors=6)


@functools.cache
def _uses_pdl(device_index: int) -> bool:
    """Programmatic dependent launch: Hopper and later, compiled code only (not the interpreter)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _launch(weight, x, out, residual, norm_weight, bias, n, eps, gated):
    """Grid (cdiv(N, BLOCK_N),): BLOCK_N = TILE // K_PAD rows a program (a power of two, at least 1); 4 warps
    keep 64 weight values a thread, 8 warps above an 8192-wide row."""
    k = x.shape[1]
    k_pad = triton.next_power_of_2(k)
    block_n = max(1, TILE // k_pad // (2 if gated else 1))
    pdl = x.is_cuda and _uses_pdl(x.device.index)
    _gemv((triton.cdiv(n, block_n),), weight, x, out, residual if residual is not None else out,
          norm_weight if norm_weight is not None else x, bias if bias is not None else x, n, eps,
          K=k, K_PAD=k_pad, BLOCK_N=block_n, NORM=norm_weight is not None, GATED=gated,
          ADD=residual is not None, HAS_BIAS=bias is not None, USE_GDC=pdl,
          num_warps=8 if k_pad > TILE else 4, num_stages=1, **({"launch_pdl": True} if pdl else {}))


def _new_output(n: int, x: torch.Tensor) -> torch.Tensor:
    """The (1, N) result row (uninitialised: every element is written; tests poison it through here)."""
    return torch.empty(1, n, dtype=x.dtype, device=x.device)


def _check(x, weight, bias, norm_weight, residual, gated) -> int:
    """-> N, the output width; ValueError on any input the kernel does not take."""
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row (1, K), got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"gemv supports {DTYPES}, got {x.dtype}")
    k = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(f"weight must be contiguous (N, {k}) {x.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight stacks [gate | up]: its rows must be even, got {weight.shape[0]}")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if gated and residual is not None:
        raise ValueError("gated and residual epilogues do not combine")
    for name, t, shape in (("bias", bias, (weight.shape[0],)), ("norm_weight", norm_weight, (k,)),
                           ("residual", residual, (1, n))):
        if t is not None and (tuple(t.shape) != shape or not t.is_contiguous() or t.dtype != x.dtype
                              or t.device != x.device):
            raise ValueError(f"{name} must be contiguous {shape} {x.dtype} on {x.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    return n


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, gated: bool = False,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, K) -> x @ weight.T (+ bias) (1, N), in x's dtype; weight (N, K).

    norm_weight (K,): x is first rms_norm(x, norm_weight, eps). gated: weight is [gate | up] (2N, K) and the
    result silu(gate) * up (1, N). residual (1, N): residual += the result in place, and residual returned.
    """
    n = _check(x, weight, bias, norm_weight, residual, gated)
    out = residual if residual is not None else _new_output(n, x)
    _launch(weight, x, out, residual, norm_weight, bias, n, float(eps), gated)
    return out
