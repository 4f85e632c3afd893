"""Triton GEMV for one token row (the batch-1 decode step), with the memory-bound ops around it fused in.

y = W x for x (1, K), W (N, K) as nn.Linear stores it, plus, chosen per call:
- a norm prologue: x <- rms_norm(x) * norm_weight, rounded to x's dtype as kernels/rmsnorm.py rounds it
  (every program norms the whole row itself: K values read from L2, cheaper than a launch);
- a gated epilogue: W stacks [gate | up] (2N, K) and the output is silu(gate x) * (up x) (N,), each half
  rounded to the model dtype first as the unfused GEMM's output is;
- a residual epilogue: residual <- residual + y in place (the pre-norm decoder's `x = x + sublayer(x)`,
  rounded as there), each output element read and written by the one program that owns its row (so x must
  not overlap it: every program reads all of x).
`gemv_rope_store` is the qkv projection's variant: RoPE on q and k and the K/V store into the paged cache as
its epilogue (kernels/rope_store.py's work, for one row).

Why a hand-written GEMV: at batch 1 a decode layer's four projections are cuBLAS GEMMs of ~3-19 us each plus
a split-K reduce, and the norms and activation are launches of their own. One program holds a tile of
BLOCK_N whole weight rows (TILE elements) in registers: loaded in one go, before its input is known, so that
with programmatic dependent launch (Hopper) the next kernel's weight reads start while this one finishes.
Measured on an H200 (torch 2.11, Triton 3.6; tools/gemv_chain_probe.py, the bench shape's 64 projections of
a 16-layer step, 1.95 GB, chained in one CUDA graph): cuBLAS 688.6 us; this kernel 564.1 us plain, 550.0
with PDL waiting first, 528.8 with the tile loaded before the wait (8192-element tiles; 16384: 532.0,
32768: 550.5). At 8 rows the same kernel takes 1,571 us against cuBLAS's 693, so it serves one row only.
Torch reference: kernels.fused_reference.gemv_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher
from kernels.pdl import pdl_options
from kernels.rope_store import check_rope_store

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE = 8192  # weight elements a program holds (per half when gated): the probe's fastest tile


@triton.jit
def _input_row(X, NORM_W, rk, k_mask, eps, K: tl.constexpr, NORM: tl.constexpr):
    """-> the input row (K_PAD,) in fp32, normed and rounded as rms_norm's output if NORM (0 past K)."""
    x = tl.load(X + rk, mask=k_mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        g = tl.load(NORM_W + rk, mask=k_mask, other=0.0).to(tl.float32)
        x = (x * rstd * g).to(X.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _dot_rows(w, x, BIAS, rn, n_mask, HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """-> w (BLOCK_N, K_PAD) . x (K_PAD,) in fp32 (+ bias), rounded to OUT_DTYPE as the GEMM output is."""
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)                    # (BLOCK_N,)
    if HAS_BIAS:
        y += tl.load(BIAS + rn, mask=n_mask, other=0.0).to(tl.float32)
    return y.to(OUT_DTYPE).to(tl.float32)


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
    # phase 2: the input row; phase 3: the dot, then the epilogue
    x = _input_row(X, NORM_W, rk, k_mask, eps, K, NORM)
    dtype = OUT.dtype.element_ty
    y = _dot_rows(w, x, BIAS, rn, n_mask, HAS_BIAS, dtype)
    if GATED:
        up = _dot_rows(u, x, BIAS + N, rn, n_mask, HAS_BIAS, dtype)
        y = y / (1.0 + tl.exp(-y)) * up
    if ADD:
        y += tl.load(RESIDUAL + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(OUT + rn, y.to(dtype), mask=n_mask)


@triton.jit
def _gemv_rope_store_kernel(
    W, X, QKV, NORM_W, BIAS, COS, SIN, K_CACHE, V_CACHE, SLOTS, eps, block_size,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_P: tl.constexpr, HALF: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, USE_GDC: tl.constexpr,
):
    """The qkv projection of one row with RoPE and the K/V store as its epilogue. A program takes BLOCK_P
    rotation pairs: pair p is element j = p % HALF of head h = p // HALF and the element HALF after it, the
    two rows that RoPE mixes, so the rotation needs nothing from another program."""
    NUM_PAIRS: tl.constexpr = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HALF
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)           # (BLOCK_P,)
    p_mask = pairs < NUM_PAIRS
    head = pairs // HALF
    j = pairs % HALF
    r1 = head * (2 * HALF) + j                                           # (BLOCK_P,) rows of qkv
    rk = tl.arange(0, K_PAD)
    k_mask = rk < K
    w_mask = p_mask[:, None] & k_mask[None, :]
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    w_ptrs = W + r1.to(tl.int64)[:, None] * K + rk[None, :]
    w1 = tl.load(w_ptrs, mask=w_mask, other=0.0)                         # (BLOCK_P, K_PAD)
    w2 = tl.load(w_ptrs + HALF * K, mask=w_mask, other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    x = _input_row(X, NORM_W, rk, k_mask, eps, K, NORM)
    dtype = QKV.dtype.element_ty
    y1 = _dot_rows(w1, x, BIAS, r1, p_mask, HAS_BIAS, dtype)
    y2 = _dot_rows(w2, x, BIAS + HALF, r1, p_mask, HAS_BIAS, dtype)
    # RoPE on the q and k heads (rotate-half, fp32, rounded once as rope_store rounds); v passes through
    rotate = head < NUM_Q_HEADS + NUM_KV_HEADS
    cos = tl.load(COS + j, mask=p_mask, other=1.0)
    sin = tl.load(SIN + j, mask=p_mask, other=0.0)
    o1 = tl.where(rotate, y1 * cos - y2 * sin, y1).to(dtype)
    o2 = tl.where(rotate, y2 * cos + y1 * sin, y2).to(dtype)
    tl.store(QKV + r1, o1, mask=p_mask)
    tl.store(QKV + r1 + HALF, o2, mask=p_mask)
    slot = tl.load(SLOTS).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        kv_head = (head - NUM_Q_HEADS).to(tl.int64)                      # k heads 0.., then v heads Hkv..
        is_k = p_mask & (head >= NUM_Q_HEADS) & rotate
        dst_k = K_CACHE + blk * stride_kb + off * stride_kt + kv_head * stride_kh + j * stride_kd
        tl.store(dst_k, o1.to(K_CACHE.dtype.element_ty), mask=is_k)
        tl.store(dst_k + HALF * stride_kd, o2.to(K_CACHE.dtype.element_ty), mask=is_k)
        is_v = p_mask & (head >= NUM_Q_HEADS + NUM_KV_HEADS)
        dst_v = (V_CACHE + blk * stride_vb + off * stride_vt + (kv_head - NUM_KV_HEADS) * stride_vh
                 + j * stride_vd)
        tl.store(dst_v, o1.to(V_CACHE.dtype.element_ty), mask=is_v)
        tl.store(dst_v + HALF * stride_vd, o2.to(V_CACHE.dtype.element_ty), mask=is_v)


_gemv = CachedLauncher(_gemv_kernel, num_tensors=6)
_gemv_rope_store = CachedLauncher(_gemv_rope_store_kernel, num_tensors=10)


def _launch(weight, x, out, residual, norm_weight, bias, n, eps, gated):
    """Grid (cdiv(N, BLOCK_N),): BLOCK_N = TILE // K_PAD rows a program (a power of two, at least 1); 4 warps
    keep 64 weight values a thread, 8 warps above an 8192-wide row."""
    k = x.shape[1]
    k_pad = triton.next_power_of_2(k)
    block_n = max(1, TILE // k_pad // (2 if gated else 1))
    _gemv((triton.cdiv(n, block_n),), weight, x, out, residual if residual is not None else out,
          norm_weight if norm_weight is not None else x, bias if bias is not None else x, n, eps,
          K=k, K_PAD=k_pad, BLOCK_N=block_n, NORM=norm_weight is not None, GATED=gated,
          ADD=residual is not None, HAS_BIAS=bias is not None, num_warps=8 if k_pad > TILE else 4,
          num_stages=1, **pdl_options(x.device))


def _new_output(n: int, x: torch.Tensor) -> torch.Tensor:
    """The (1, N) result row (uninitialised: every element is written; tests poison it through here)."""
    return torch.empty(1, n, dtype=x.dtype, device=x.device)


def _launch_rope_store(weight, x, qkv, norm_weight, bias, eps, cos, sin, k_cache, v_cache, slots, hq, hkv):
    """Grid (cdiv(pairs, BLOCK_P),): a program holds 2 BLOCK_P weight rows, TILE elements in all."""
    k = x.shape[1]
    k_pad = triton.next_power_of_2(k)
    half = k_cache.shape[-1] // 2
    block_p = max(1, TILE // k_pad // 2)
    _gemv_rope_store((triton.cdiv((hq + 2 * hkv) * half, block_p),), weight, x, qkv,
                     norm_weight if norm_weight is not None else x, bias if bias is not None else x,
                     cos, sin, k_cache, v_cache, slots, eps, k_cache.shape[1],
                     *k_cache.stride(), *v_cache.stride(),
                     K=k, K_PAD=k_pad, BLOCK_P=block_p, HALF=half, NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv,
                     NORM=norm_weight is not None, HAS_BIAS=bias is not None,
                     num_warps=8 if k_pad > TILE else 4, num_stages=1, **pdl_options(x.device))


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
    if residual is not None and _overlap(x, residual):
        raise ValueError("x and residual overlap: the residual epilogue writes rows every program reads")
    return n


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two contiguous tensors intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


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


def gemv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                    norm_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The qkv projection of one row with RoPE and the K/V store fused in: x (1, K) -> qkv (1, (Hq + 2 Hkv) D)
    as gemv(x, weight, bias, norm_weight=, eps=) followed by kernels.rope_store.rope_store_kv(qkv, cos, sin,
    k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads) computes it (q and k rotated in the result,
    the rotated k and the v written to the caches at slot_mapping[0] unless it is < 0)."""
    _check(x, weight, bias, norm_weight, None, False)
    qkv = _new_output(weight.shape[0], x)
    check_rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)
    if k_cache.device != x.device or cos.device != x.device or slot_mapping.device != x.device:
        raise ValueError(f"the caches, cos/sin and slot_mapping must be on x's device {x.device}")
    _launch_rope_store(weight, x, qkv, norm_weight, bias, float(eps), cos, sin, k_cache, v_cache,
                       slot_mapping, num_q_heads, num_kv_heads)
    return qkv
