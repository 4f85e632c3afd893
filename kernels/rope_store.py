"""Triton RoPE on q and k together with the K/V store into the paged cache: one launch per layer.

The qkv projection's output (T, (Hq + 2 Hkv) D) holds each token's q heads, k heads and v heads back to back.
One program per token rotates its q and k heads in place (rotate-half layout: element i pairs with
i + D/2) and writes the rotated k and the v into the cache slot the slot mapping gives
(slot = block_id * block_size + offset; slot < 0 is a padding row and stores nothing). The unfused path
spends about six elementwise launches on RoPE and one on the store; this reads qkv once.

With `norm_of` the pre-attention RMSNorm happens here, after the GEMM (the fused forward's folded norms,
server/model/norm_folding.py): qkv is then the projection of the un-normed residual row r by weights that hold
the norm's weight, and every head (v too, written back into its row, which the prefill kernel reads) is first
scaled by rsqrt(mean(r^2) + eps), then gains the projection's bias, before RoPE and the store.
Torch reference: kernels.fused_reference.rope_store_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher
from kernels.rmsnorm import check_row_extras, row_rstd

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_heads(HEADS, BIAS, offs_h, offs_i, mask, scale, HALF: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The (heads, 2 * HALF) tile at HEADS as two fp32 halves, scaled, plus the bias at BIAS (same layout)."""
    tile = offs_h[:, None] * (2 * HALF) + offs_i[None, :]              # (HP, HALF_PAD)
    x1 = tl.load(HEADS + tile, mask=mask, other=0.0).to(tl.float32) * scale
    x2 = tl.load(HEADS + tile + HALF, mask=mask, other=0.0).to(tl.float32) * scale
    if HAS_BIAS:
        x1 += tl.load(BIAS + tile, mask=mask, other=0.0).to(tl.float32)
        x2 += tl.load(BIAS + tile + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _rotate_heads(HEADS, BIAS, offs_h, offs_i, mask, cos, sin, scale, HALF: tl.constexpr,
                  HAS_BIAS: tl.constexpr):
    """Rotates the (heads, 2 * HALF) tile at HEADS in place (scaled and biased first); -> its two rotated
    halves in fp32."""
    first = HEADS + offs_h[:, None] * (2 * HALF) + offs_i[None, :]       # (HP, HALF_PAD)
    x1, x2 = _load_heads(HEADS, BIAS, offs_h, offs_i, mask, scale, HALF, HAS_BIAS)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, o1.to(HEADS.dtype.element_ty), mask=mask)
    tl.store(first + HALF, o2.to(HEADS.dtype.element_ty), mask=mask)
    return o1, o2


@triton.jit
def _rope_store_kernel(
    QKV, COS, SIN, K_CACHE, V_CACHE, SLOTS, RESIDUAL, BIAS, block_size, eps,
    stride_t, stride_cos, stride_sin, stride_r,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    NORM: tl.constexpr, HIDDEN: tl.constexpr, H_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    REWRITE_V: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)                                     # (HALF_PAD,) pair index
    in_half = offs_i < HALF
    cos = tl.load(COS + t * stride_cos + offs_i, mask=in_half, other=0.0)
    sin = tl.load(SIN + t * stride_sin + offs_i, mask=in_half, other=0.0)
    row = QKV + t * stride_t
    scale = 1.0
    if NORM:  # the folded pre-attention norm: scale the projection of the un-normed row
        scale = row_rstd(RESIDUAL + t * stride_r, eps, HIDDEN, H_BLOCK)
    # phase 1: q heads, rotated in place
    offs_q = tl.arange(0, Q_PAD)
    q_mask = (offs_q[:, None] < NUM_Q_HEADS) & in_half[None, :]
    _rotate_heads(row, BIAS, offs_q, offs_i, q_mask, cos, sin, scale, HALF, HAS_BIAS)
    # phase 2: k heads, rotated in place and kept in registers for the store
    offs_k = tl.arange(0, KV_PAD)
    kv_mask = (offs_k[:, None] < NUM_KV_HEADS) & in_half[None, :]
    k_off = NUM_Q_HEADS * 2 * HALF
    k1, k2 = _rotate_heads(row + k_off, BIAS + k_off, offs_k, offs_i, kv_mask, cos, sin, scale, HALF,
                           HAS_BIAS)
    # phase 3: v heads, scaled and biased in place (their row is what attention reads of the new tokens)
    v_off = (NUM_Q_HEADS + NUM_KV_HEADS) * 2 * HALF
    v1, v2 = _load_heads(row + v_off, BIAS + v_off, offs_k, offs_i, kv_mask, scale, HALF, HAS_BIAS)
    v1 = v1.to(QKV.dtype.element_ty)
    v2 = v2.to(QKV.dtype.element_ty)
    if REWRITE_V:  # NORM or HAS_BIAS
        src_v = row + v_off + offs_k[:, None] * (2 * HALF) + offs_i[None, :]
        tl.store(src_v, v1, mask=kv_mask)
        tl.store(src_v + HALF, v2, mask=kv_mask)
    # phase 4: rotated k and v into the token's cache slot
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        dst_k = (K_CACHE + blk * stride_kb + off * stride_kt + offs_k[:, None] * stride_kh
                 + offs_i[None, :] * stride_kd)
        tl.store(dst_k, k1.to(K_CACHE.dtype.element_ty), mask=kv_mask)
        tl.store(dst_k + HALF * stride_kd, k2.to(K_CACHE.dtype.element_ty), mask=kv_mask)
        dst_v = (V_CACHE + blk * stride_vb + off * stride_vt + offs_k[:, None] * stride_vh
                 + offs_i[None, :] * stride_vd)
        tl.store(dst_v, v1.to(V_CACHE.dtype.element_ty), mask=kv_mask)
        tl.store(dst_v + HALF * stride_vd, v2.to(V_CACHE.dtype.element_ty), mask=kv_mask)


_rope_store = CachedLauncher(_rope_store_kernel, num_tensors=8)


def _launch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, norm_of, eps, bias):
    """Grid (T,): q and k tiles padded to powers of two (heads x D/2) and masked."""
    half = k_cache.shape[-1] // 2
    q_pad, kv_pad = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_kv_heads)
    half_pad = triton.next_power_of_2(half)
    warps = 4 if q_pad * half_pad >= 1024 else 1
    res = qkv if norm_of is None else norm_of                           # unread without NORM
    _rope_store(
        (qkv.shape[0],), qkv, cos, sin, k_cache, v_cache, slot_mapping, res,
        qkv if bias is None else bias, k_cache.shape[1], float(eps),
        qkv.stride(0), cos.stride(0), sin.stride(0), res.stride(0), *k_cache.stride(), *v_cache.stride(),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, Q_PAD=q_pad, KV_PAD=kv_pad, HALF=half,
        HALF_PAD=half_pad, NORM=norm_of is not None, HIDDEN=res.shape[1],
        H_BLOCK=triton.next_power_of_2(res.shape[1]), HAS_BIAS=bias is not None,
        REWRITE_V=norm_of is not None or bias is not None, num_warps=warps, num_stages=1)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int,
                  num_kv_heads: int, *, norm_of: torch.Tensor | None = None, eps: float = 0.0,
                  bias: torch.Tensor | None = None) -> None:
    """RoPE on q and k of qkv (T, (Hq + 2 Hkv) D), in place, and the rotated k and v stored into
    k_cache / v_cache (num_blocks, block_size, Hkv, D; any strides) at slot_mapping (T,) (< 0: skip).

    cos, sin (T, D/2) fp32: the angle of pair i of token t, cos(position_t * inv_freq_i).
    norm_of (T, H): every row of qkv is first scaled by rsqrt(mean(norm_of_row^2) + eps); bias
    ((Hq + 2 Hkv) D,): then added (the qkv projection's own, left out of its GEMM); v is then rewritten in
    place too.
    """
    check_rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)
    check_row_extras(qkv, norm_of, bias)
    if qkv.shape[0]:
        _launch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads, norm_of, eps, bias)


def check_rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads: int,
                     num_kv_heads: int) -> None:
    """ValueError unless qkv, cos/sin, the caches and the slot mapping are what rope_store_kv takes (also the
    checks of kernels.gemv.gemv_rope_store, whose output row is qkv)."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2] != num_kv_heads or d % 2:
        raise ValueError(f"k_cache/v_cache must be (N, block_size, {num_kv_heads}, D) with an even D, got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if qkv.dim() != 2 or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * d or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be (T, {(num_q_heads + 2 * num_kv_heads) * d}) with contiguous rows, "
                         f"got shape {tuple(qkv.shape)} strides {qkv.stride()}")
    if qkv.dtype not in DTYPES or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(f"qkv and the caches must share one dtype of {DTYPES}, got {qkv.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.shape != (t, d // 2) or c.dtype != torch.float32 or c.stride(-1) != 1:
            raise ValueError(f"{name} must be ({t}, {d // 2}) float32 with contiguous rows, got "
                             f"{tuple(c.shape)} {c.dtype}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype.is_floating_point:
        raise ValueError(f"slot_mapping must be ({t},) integers, got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
