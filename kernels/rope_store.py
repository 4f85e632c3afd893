"""Triton RoPE on q and k together with the K/V store into the paged cache: one launch per layer.

The qkv projection's output (T, (Hq + 2 Hkv) D) holds each token's q heads, k heads and v heads back to back.
One program per token rotates its q and k heads in place (rotate-half layout: element i pairs with
i + D/2) and writes the rotated k and the v into the cache slot the slot mapping gives
(slot = block_id * block_size + offset; slot < 0 is a padding row and stores nothing). The unfused path
spends about six elementwise launches on RoPE and one on the store; this reads qkv once.
Torch reference: kernels.fused_reference.rope_store_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(HEADS, offs_h, offs_i, mask, cos, sin, HALF: tl.constexpr):
    """Rotates the (heads, 2 * HALF) tile at HEADS in place; -> its two rotated halves in fp32."""
    first = HEADS + offs_h[:, None] * (2 * HALF) + offs_i[None, :]       # (HP, HALF_PAD)
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, o1.to(HEADS.dtype.element_ty), mask=mask)
    tl.store(first + HALF, o2.to(HEADS.dtype.element_ty), mask=mask)
    return o1, o2


@triton.jit
def _rope_store_kernel(
    QKV, COS, SIN, K_CACHE, V_CACHE, SLOTS, block_size,
    stride_t, stride_cos, stride_sin,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)                                     # (HALF_PAD,) pair index
    in_half = offs_i < HALF
    cos = tl.load(COS + t * stride_cos + offs_i, mask=in_half, other=0.0)
    sin = tl.load(SIN + t * stride_sin + offs_i, mask=in_half, other=0.0)
    row = QKV + t * stride_t
    # phase 1: q heads, rotated in place
    offs_q = tl.arange(0, Q_PAD)
    q_mask = (offs_q[:, None] < NUM_Q_HEADS) & in_half[None, :]
    _rotate_heads(row, offs_q, offs_i, q_mask, cos, sin, HALF)
    # phase 2: k heads, rotated in place and kept in registers for the store
    offs_k = tl.arange(0, KV_PAD)
    kv_mask = (offs_k[:, None] < NUM_KV_HEADS) & in_half[None, :]
    k1, k2 = _rotate_heads(row + NUM_Q_HEADS * 2 * HALF, offs_k, offs_i, kv_mask, cos, sin, HALF)
    # phase 3: rotated k and plain v into the token's cache slot
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        dst_k = (K_CACHE + blk * stride_kb + off * stride_kt + offs_k[:, None] * stride_kh
                 + offs_i[None, :] * stride_kd)
        tl.store(dst_k, k1.to(K_CACHE.dtype.element_ty), mask=kv_mask)
        tl.store(dst_k + HALF * stride_kd, k2.to(K_CACHE.dtype.element_ty), mask=kv_mask)
        v_heads = row + (NUM_Q_HEADS + NUM_KV_HEADS) * 2 * HALF
        src_v = v_heads + offs_k[:, None] * (2 * HALF) + offs_i[None, :]
        dst_v = (V_CACHE + blk * stride_vb + off * stride_vt + offs_k[:, None] * stride_vh
                 + offs_i[None, :] * stride_vd)
        v1 = tl.load(src_v, mask=kv_mask)
        v2 = tl.load(src_v + HALF, mask=kv_mask)
        tl.store(dst_v, v1.to(V_CACHE.dtype.element_ty), mask=kv_mask)
        tl.store(dst_v + HALF * stride_vd, v2.to(V_CACHE.dtype.element_ty), mask=kv_mask)


_rope_store = CachedLauncher(_rope_store_kernel, num_tensors=6)


def _launch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads):
    """Grid (T,): q and k tiles padded to powers of two (heads x D/2) and masked."""
    half = k_cache.shape[-1] // 2
    q_pad, kv_pad = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_kv_heads)
    half_pad = triton.next_power_of_2(half)
    warps = 4 if q_pad * half_pad >= 1024 else 1
    _rope_store(
        (qkv.shape[0],), qkv, cos, sin, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        qkv.stride(0), cos.stride(0), sin.stride(0), *k_cache.stride(), *v_cache.stride(),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, Q_PAD=q_pad, KV_PAD=kv_pad, HALF=half,
        HALF_PAD=half_pad, num_warps=warps, num_stages=1)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int,
                  num_kv_heads: int) -> None:
    """RoPE on q and k of qkv (T, (Hq + 2 Hkv) D), in place, and the rotated k and v stored into
    k_cache / v_cache (num_blocks, block_size, Hkv, D; any strides) at slot_mapping (T,) (< 0: skip).

    cos, sin (T, D/2) fp32: the angle of pair i of token t, cos(position_t * inv_freq_i).
    """
    check_rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)
    if qkv.shape[0]:
        _launch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)


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
