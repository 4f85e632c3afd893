"""Triton store_kv kernel (module named kv_store so it never shadows the kernels.store_kv function).

One program per token: slot = block_id * block_size + offset (from kvcache's slot mapping); slot < 0 is
padding and is skipped. key/value (T, Hkv, D) and the caches (N, block_size, Hkv, D) may have any strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher


@triton.jit
def _store_kv_kernel(
    KEY, VALUE, K_CACHE, V_CACHE, SLOTS, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    stride_db, stride_dt, stride_dh, stride_dd,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, HEADS_PAD)                                # (HP,)
        offs_d = tl.arange(0, HEAD_DIM_PAD)                             # (DP,)
        mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
        src_k = KEY + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
        src_v = VALUE + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
        dst_k = (K_CACHE + blk * stride_cb + off * stride_ct + offs_h[:, None] * stride_ch
                 + offs_d[None, :] * stride_cd)
        dst_v = (V_CACHE + blk * stride_db + off * stride_dt + offs_h[:, None] * stride_dh
                 + offs_d[None, :] * stride_dd)
        k = tl.load(src_k, mask=mask)
        v = tl.load(src_v, mask=mask)
        tl.store(dst_k, k.to(K_CACHE.dtype.element_ty), mask=mask)
        tl.store(dst_v, v.to(V_CACHE.dtype.element_ty), mask=mask)


_store = CachedLauncher(_store_kv_kernel, num_tensors=5)


def _launch(key, value, k_cache, v_cache, slot_mapping):
    """Grid (T,); the (Hkv, D) tile of a token is padded to powers of two and masked."""
    t, hkv, d = key.shape
    heads_pad, d_pad = triton.next_power_of_2(hkv), triton.next_power_of_2(d)
    warps = 4 if heads_pad * d_pad >= 1024 else 1
    _store(
        (t,), key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_HEADS=hkv, HEADS_PAD=heads_pad, HEAD_DIM=d, HEAD_DIM_PAD=d_pad, num_warps=warps, num_stages=1)


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping):
    """Checked entry point (dispatch has validated shapes, dtype and backend)."""
    if slot_mapping.dtype.is_floating_point:
        raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
    if key.shape[0] == 0:
        return
    _launch(key, value, k_cache, v_cache, slot_mapping)
