"""Triton GEMMs for a decode step's few rows, with the memory-bound op after them as their epilogue.

Both take the un-normed residual stream x (M, K) and a projection whose weight holds the folded pre-norm's
weight (server/model/norm_folding.py), and apply the norm's row scale rsqrt(mean(x^2) + eps) after the dot:
the program has every x tile of its rows in registers for the dot anyway, so it sums their squares on the way
and the norm costs no extra read. Each program computes two products of one x tile, against two sets of
weight rows that its epilogue combines, so the epilogue needs nothing from another program:
- `gated_gemm`, the gate_up projection: gate columns and the same up columns, then SiLU-and-mul
  (kernels/activation.py's work) -> act (M, I);
- `gemm_rope_store`, the qkv projection: rotation pairs, element j of a head and the element D/2 after it
  (the two RoPE mixes), then RoPE on q and k and the K/V store into the paged cache (kernels/rope_store.py's
  work) -> qkv (M, (Hq + 2 Hkv) D).
`gemm_add` is the plain GEMM of the two projections that add into the stream (o_proj): residual += x W^T,
each output tile read and written by the program that computes it.
One launch each where the GEMM route runs a cuBLAS GEMM and then the elementwise kernel, and no re-read of
the GEMM's output. Rounding is the GEMM route's: each product is rounded to the model dtype (as the cuBLAS
output is), then scaled, biased and finished in fp32 and rounded once, as the elementwise kernels do.

They serve the multi-row decode steps up to MAX_ROWS rows, where one BLOCK_M tile covers the batch and the
weights are read once; cuBLAS keeps the larger batches and prefill (tools/fused_gemm_probe.py times both
routes per row count; docs/benchmarks/decode_forward_h200.md has the measurement).
Torch references: kernels.fused_reference.gated_gemm_reference, gemm_rope_store_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher
from kernels.rope_store import check_rope_store

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 64  # the largest batch the fused forward gives these kernels (one row tile: weights read once)
BLOCK_M = 64   # the largest row tile
BLOCK_N = 64   # gated: gate columns a program (and as many up columns): 128 programs for I = 8192
BLOCK_P = 16   # rope: rotation pairs a program: 96 programs for the bench's 48 heads of 64
BLOCK_ADD_N = 16  # gemm_add: output columns a program: 128 programs for o_proj's N = 2048
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4


@triton.jit
def _paired_dot(X, W, stride_x, rm, m_ok, rows_a, rows_b, n_ok,
                K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr, PAIRED: tl.constexpr = True):
    """-> (x W[rows_a]^T, x W[rows_b]^T, sum of x^2 per row) in fp32, (BLOCK_M, BLOCK_N) twice and
    (BLOCK_M,), for x = X's rows rm (M, K) and W (N, K) row-major; rows past m_ok / n_ok read as 0.
    Not PAIRED: the second product is left 0 (rows_b unread)."""
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X + rm.to(tl.int64)[:, None] * stride_x + rk[None, :]       # (BLOCK_M, BLOCK_K)
    a_ptrs = W + rows_a.to(tl.int64)[:, None] * K + rk[None, :]          # (BLOCK_N, BLOCK_K)
    b_ptrs = W + rows_b.to(tl.int64)[:, None] * K + rk[None, :]
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        wa = tl.load(a_ptrs, mask=w_mask, other=0.0)
        acc_a = tl.dot(x, tl.trans(wa), acc_a, input_precision=PRECISION)
        if PAIRED:
            wb = tl.load(b_ptrs, mask=w_mask, other=0.0)
            acc_b = tl.dot(x, tl.trans(wb), acc_b, input_precision=PRECISION)
        xf = x.to(tl.float32)
        sum_sq += tl.sum(xf * xf, axis=1)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc_a, acc_b, sum_sq


@triton.jit
def _finish(acc, sum_sq, BIAS, cols, n_ok, eps, K: tl.constexpr, dtype: tl.constexpr, NORM: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    """The GEMM route's product (BLOCK_M, BLOCK_N) as the elementwise kernels receive and scale it: rounded
    to dtype, times the row scale if NORM, plus the bias at cols if HAS_BIAS, in fp32."""
    y = acc.to(dtype).to(tl.float32)
    if NORM:
        y *= tl.rsqrt(sum_sq / K + eps)[:, None]
    if HAS_BIAS:
        y += tl.load(BIAS + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return y


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
    m_ok = rm < M
    n_ok = rn < INTER
    acc_g, acc_u, sum_sq = _paired_dot(X, W, stride_x, rm, m_ok, rn, rn + INTER, n_ok, K, BLOCK_M, BLOCK_N,
                                       BLOCK_K, PRECISION)
    dtype = OUT.dtype.element_ty
    gate = _finish(acc_g, sum_sq, BIAS, rn, n_ok, eps, K, dtype, NORM, HAS_BIAS)
    up = _finish(acc_u, sum_sq, BIAS, rn + INTER, n_ok, eps, K, dtype, NORM, HAS_BIAS)
    y = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = OUT + rm.to(tl.int64)[:, None] * stride_out + rn[None, :]
    tl.store(out_ptrs, y.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemm_rope_store_kernel(
    X, W, QKV, BIAS, COS, SIN, K_CACHE, V_CACHE, SLOTS, M, eps, block_size,
    stride_x, stride_qkv, stride_cos, stride_sin,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    K: tl.constexpr, HALF: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (p, m) writes rotation pairs p tile of rows m tile: pair i is element j = i % HALF of head
    h = i // HALF and the element HALF after it (rows r1 and r1 + HALF of W and of qkv)."""
    NUM_PAIRS: tl.constexpr = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HALF
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)             # (BLOCK_M,) tokens
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)           # (BLOCK_P,)
    m_ok = rm < M
    p_ok = pairs < NUM_PAIRS
    head = pairs // HALF
    j = pairs % HALF
    r1 = head * (2 * HALF) + j                                           # (BLOCK_P,) columns of qkv
    acc_1, acc_2, sum_sq = _paired_dot(X, W, stride_x, rm, m_ok, r1, r1 + HALF, p_ok, K, BLOCK_M, BLOCK_P,
                                       BLOCK_K, PRECISION)
    dtype = QKV.dtype.element_ty
    y1 = _finish(acc_1, sum_sq, BIAS, r1, p_ok, eps, K, dtype, NORM, HAS_BIAS)
    y2 = _finish(acc_2, sum_sq, BIAS, r1 + HALF, p_ok, eps, K, dtype, NORM, HAS_BIAS)
    # RoPE on the q and k heads (rotate-half, fp32, rounded once as rope_store rounds); v passes through
    tile_ok = m_ok[:, None] & p_ok[None, :]
    cos = tl.load(COS + rm[:, None] * stride_cos + j[None, :], mask=tile_ok, other=1.0)
    sin = tl.load(SIN + rm[:, None] * stride_sin + j[None, :], mask=tile_ok, other=0.0)
    rotate = (head < NUM_Q_HEADS + NUM_KV_HEADS)[None, :]
    o1 = tl.where(rotate, y1 * cos - y2 * sin, y1).to(dtype)
    o2 = tl.where(rotate, y2 * cos + y1 * sin, y2).to(dtype)
    out = QKV + rm.to(tl.int64)[:, None] * stride_qkv + r1[None, :]
    tl.store(out, o1, mask=tile_ok)
    tl.store(out + HALF, o2, mask=tile_ok)
    # the rotated k and the v into each token's cache slot (slot < 0: a padding row, nothing stored)
    slot = tl.load(SLOTS + rm, mask=m_ok, other=-1).to(tl.int64)
    stored = (m_ok & (slot >= 0))[:, None]
    blk = (slot // block_size)[:, None]
    off = (slot % block_size)[:, None]
    kv_head = (head - NUM_Q_HEADS).to(tl.int64)[None, :]                # k heads 0.., then v heads Hkv..
    is_k = stored & (p_ok & (head >= NUM_Q_HEADS) & (head < NUM_Q_HEADS + NUM_KV_HEADS))[None, :]
    dst_k = K_CACHE + blk * stride_kb + off * stride_kt + kv_head * stride_kh + j[None, :] * stride_kd
    tl.store(dst_k, o1.to(K_CACHE.dtype.element_ty), mask=is_k)
    tl.store(dst_k + HALF * stride_kd, o2.to(K_CACHE.dtype.element_ty), mask=is_k)
    is_v = stored & (p_ok & (head >= NUM_Q_HEADS + NUM_KV_HEADS))[None, :]
    dst_v = (V_CACHE + blk * stride_vb + off * stride_vt + (kv_head - NUM_KV_HEADS) * stride_vh
             + j[None, :] * stride_vd)
    tl.store(dst_v, o1.to(V_CACHE.dtype.element_ty), mask=is_v)
    tl.store(dst_v + HALF * stride_vd, o2.to(V_CACHE.dtype.element_ty), mask=is_v)


@triton.jit
def _gemm_add_kernel(
    X, W, RESIDUAL, BIAS, M, stride_x, stride_r,
    K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (n, m) adds x W^T (+ bias) into RESIDUAL[m tile, n tile], the one program that reads and
    writes those elements: the sum in fp32, rounded once (cuBLAS addmm with beta = 1; with a bias, the
    biased product is rounded before the add)."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc, _, _ = _paired_dot(X, W, stride_x, rm, m_ok, rn, rn, n_ok, K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                            PAIRED=False)
    if HAS_BIAS:  # the projection's output rounded first, as residual.add_(F.linear(x, w, b)) rounds it
        acc += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc = acc.to(RESIDUAL.dtype.element_ty).to(tl.float32)
    ptrs = RESIDUAL + rm.to(tl.int64)[:, None] * stride_r + rn[None, :]
    tile_ok = m_ok[:, None] & n_ok[None, :]
    y = acc + tl.load(ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    tl.store(ptrs, y.to(RESIDUAL.dtype.element_ty), mask=tile_ok)


_gated_gemm = CachedLauncher(_gated_gemm_kernel, num_tensors=4)
_gemm_add = CachedLauncher(_gemm_add_kernel, num_tensors=4)
_gemm_rope_store = CachedLauncher(_gemm_rope_store_kernel, num_tensors=9)


def _tile(extent: int, cap: int) -> int:
    """A tensor-core tile dimension: extent padded to a power of two, 16 at least, cap at most."""
    return min(cap, max(16, triton.next_power_of_2(extent)))


def _options(x: torch.Tensor) -> dict:
    """The dot precision (fp32 exact, not TF32) and the pipeline: 4 stages of (x + 2 weight tiles), 48 KB
    each at the bench's gated tile, in the H200's 228 KB of shared memory."""
    return dict(PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS,
                num_stages=NUM_STAGES)


def _launch_gated(x, weight, out, bias, norm, eps):
    """Grid (cdiv(I, BLOCK_N), cdiv(M, BLOCK_M))."""
    m, k = x.shape
    inter = out.shape[1]
    block_m, block_n = _tile(m, BLOCK_M), _tile(inter, BLOCK_N)
    _gated_gemm((triton.cdiv(inter, block_n), triton.cdiv(m, block_m)), x, weight, out,
                x if bias is None else bias, m, float(eps), x.stride(0), out.stride(0),
                K=k, INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_tile(k, BLOCK_K), NORM=norm,
                HAS_BIAS=bias is not None, **_options(x))


def _launch_rope_store(x, weight, qkv, bias, norm, eps, cos, sin, k_cache, v_cache, slots, hq, hkv):
    """Grid (cdiv(pairs, BLOCK_P), cdiv(M, BLOCK_M))."""
    m, k = x.shape
    half = k_cache.shape[-1] // 2
    pairs = (hq + 2 * hkv) * half
    block_m, block_p = _tile(m, BLOCK_M), _tile(pairs, BLOCK_P)
    _gemm_rope_store((triton.cdiv(pairs, block_p), triton.cdiv(m, block_m)), x, weight, qkv,
                     x if bias is None else bias, cos, sin, k_cache, v_cache, slots, m, float(eps),
                     k_cache.shape[1], x.stride(0), qkv.stride(0), cos.stride(0), sin.stride(0),
                     *k_cache.stride(), *v_cache.stride(),
                     K=k, HALF=half, NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, BLOCK_M=block_m, BLOCK_P=block_p,
                     BLOCK_K=_tile(k, BLOCK_K), NORM=norm, HAS_BIAS=bias is not None, **_options(x))


def _launch_add(x, weight, residual, bias):
    """Grid (cdiv(N, BLOCK_ADD_N), cdiv(M, BLOCK_M))."""
    m, k = x.shape
    n = weight.shape[0]
    block_m, block_n = _tile(m, BLOCK_M), _tile(n, BLOCK_ADD_N)
    _gemm_add((triton.cdiv(n, block_n), triton.cdiv(m, block_m)), x, weight, residual,
              x if bias is None else bias, m, x.stride(0), residual.stride(0),
              K=k, N=n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_tile(k, BLOCK_K),
              HAS_BIAS=bias is not None, **_options(x))


def _new_output(m: int, n: int, x: torch.Tensor) -> torch.Tensor:
    """The (M, N) result (uninitialised: every element is written; tests poison it through here)."""
    return torch.empty(m, n, dtype=x.dtype, device=x.device)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> None:
    """ValueError on any x, weight, bias the kernels do not take."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be (M, K) with contiguous rows, got shape {tuple(x.shape)} strides "
                         f"{x.stride()}")
    if x.dtype not in DTYPES:
        raise ValueError(f"the fused GEMMs support {DTYPES}, got {x.dtype}")
    k = x.shape[1]
    if (weight.dim() != 2 or weight.shape[1] != k or (gated and weight.shape[0] % 2)
            or not weight.is_contiguous() or weight.dtype != x.dtype or weight.device != x.device):
        what = "[gate | up] (2I, K)" if gated else "(N, K)"
        raise ValueError(f"weight must be contiguous {what} with K = {k}, {x.dtype} on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or not bias.is_contiguous()
                             or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"bias must be contiguous ({weight.shape[0]},) {x.dtype} on {x.device}, got "
                         f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")


def gated_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               norm: bool = False, eps: float = 0.0) -> torch.Tensor:
    """x (M, K), weight [gate | up] (2I, K) -> silu(gate) * up (M, I) in x's dtype, where
    [gate | up] = x @ weight.T, each row scaled by rsqrt(mean(x_row^2) + eps) if norm, then + bias (2I,):
    what silu_and_mul(F.linear(x, weight), norm_of=x if norm else None, eps=eps, bias=bias) computes."""
    _check(x, weight, bias, gated=True)
    out = _new_output(x.shape[0], weight.shape[0] // 2, x)
    if x.shape[0]:
        _launch_gated(x, weight, out, bias, norm, eps)
    return out


def gemm_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, norm: bool,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int,
                    num_kv_heads: int) -> torch.Tensor:
    """The qkv projection with RoPE and the K/V store fused in: x (M, K) -> qkv (M, (Hq + 2 Hkv) D) as
    qkv = F.linear(x, weight) then kernels.rope_store.rope_store_kv(qkv, cos, sin, k_cache, v_cache,
    slot_mapping, num_q_heads, num_kv_heads, norm_of=x if norm else None, eps=eps, bias=bias) computes it."""
    _check(x, weight, bias, gated=False)
    qkv = _new_output(x.shape[0], weight.shape[0], x)
    check_rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)
    if k_cache.device != x.device or cos.device != x.device or slot_mapping.device != x.device:
        raise ValueError(f"the caches, cos/sin and slot_mapping must be on x's device {x.device}")
    if x.shape[0]:
        _launch_rope_store(x, weight, qkv, bias, norm, eps, cos, sin, k_cache, v_cache, slot_mapping,
                           num_q_heads, num_kv_heads)
    return qkv


def gemm_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """residual (M, N) += x (M, K) @ weight.T (N, K) (+ bias (N,)), in place, each sum rounded once to
    residual's dtype as residual.addmm_(x, weight.t()) rounds it; -> residual. x must not overlap residual
    (every program reads its x rows whole while others write their residual tiles)."""
    _check(x, weight, bias, gated=False)
    m, n = x.shape[0], weight.shape[0]
    if (residual.shape != (m, n) or residual.stride(-1) != 1 or residual.dtype != x.dtype
            or residual.device != x.device):
        raise ValueError(f"residual must be ({m}, {n}) {x.dtype} on {x.device} with contiguous rows, got "
                         f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if _overlap(x, residual):
        raise ValueError("x and residual overlap: the epilogue writes residual tiles that programs read as x")
    if m:
        _launch_add(x, weight, residual, bias)
    return residual


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two row-strided tensors intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + ((a.shape[0] - 1) * a.stride(0) + a.shape[1]) * a.element_size()
    b1 = b0 + ((b.shape[0] - 1) * b.stride(0) + b.shape[1]) * b.element_size()
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1
