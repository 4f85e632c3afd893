"""A decode step's new tokens, rotated and stored by the decode attention launch itself.

A decode-only step's qkv projection (B, (Hq + 2 Hkv) D) holds each sequence's one new token: its q heads, k
heads and v heads back to back, un-rotated (and on the fused forward's folded norms un-normed:
server/model/norm_folding.py). Given `NewTokens`, the paged-decode kernel (kernels/paged_decode.py) takes
those rows as they are: each (KV head, sequence, split) program scales its group's q heads by the row's
RMSNorm factor, adds the bias and rotates them in registers; the program whose split holds position
seq_len - 1 does the same for its K head, scales its V head, and writes both into the token's cache slot
before its tile loop reads that position (a CTA barrier orders the stores before the loads; no other
program reads that position). One launch a layer where kernels/rope_store.py's kernel and the attention
took two. Every value is computed and rounded as rope_store rounds it (q, k after RoPE, v after its scale
and bias), so the attention sees the q, k and v it would have read after that kernel; the qkv rows
themselves are left as projected (a decode step reads them nowhere else).
Torch path: `reference_query` (kernels.fused_reference.rope_store_reference on a copy of qkv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fused_reference import rope_store_reference
from kernels.rmsnorm import check_row_extras
from kernels.rope_store import check_rope_store


@dataclass(frozen=True)
class NewTokens:
    """What a decode launch needs to rotate and store its rows' new tokens itself.

    qkv (B, (Hq + 2 Hkv) D) with contiguous rows: the projection; the launch's q must be its q heads,
    qkv.view(B, Hq + 2 Hkv, D)[:, :Hq]. cos, sin (B, D/2) fp32: each row's angles. slot_mapping (B,): the
    new token's cache slot, that of position seq_len - 1 (< 0: a padding row, nothing stored). norm_of
    (B, H) / eps / bias ((Hq + 2 Hkv) D,) as kernels.rope_store.rope_store_kv's."""

    qkv: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    norm_of: torch.Tensor | None = None
    eps: float = 0.0
    bias: torch.Tensor | None = None

    def check(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """ValueError unless these rows are what rope_store_kv takes and q is the q heads of qkv."""
        hq, hkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
        check_rope_store(self.qkv, self.cos, self.sin, k_cache, v_cache, self.slot_mapping, hq, hkv)
        check_row_extras(self.qkv, self.norm_of, self.bias)
        if (q.data_ptr() != self.qkv.data_ptr() or q.shape[0] != self.qkv.shape[0]
                or q.stride() != (self.qkv.stride(0), d, 1)):
            raise ValueError(f"q must be the q heads of new_tokens.qkv, qkv.view(B, {hq + 2 * hkv}, {d})"
                             f"[:, :{hq}]; got shape {tuple(q.shape)} strides {q.stride()}")
        if self.cos.stride() != self.sin.stride():
            raise ValueError(f"cos and sin must share strides, got {self.cos.stride()}, {self.sin.stride()}")

    def reference_query(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int) -> torch.Tensor:
        """The torch path: rope_store_reference on a copy of qkv (the caches gain the new K/V) -> the rotated
        q heads (B, Hq, D)."""
        qkv = self.qkv.clone()
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        rope_store_reference(qkv, self.cos, self.sin, k_cache, v_cache, self.slot_mapping, num_q_heads, hkv,
                             self.norm_of, self.eps, self.bias)
        return qkv.view(qkv.shape[0], num_q_heads + 2 * hkv, d)[:, :num_q_heads]

    @staticmethod
    def scratch(rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int, norm_width: int | None,
                bias: torch.Tensor | None, eps: float, dtype: torch.dtype, device) -> NewTokens:
        """Zero rows with padding slots (stores nothing), shaped as a step's: for compiling the variant."""
        width = (num_q_heads + 2 * num_kv_heads) * head_dim
        qkv = torch.zeros(rows, width, dtype=dtype, device=device)
        cos = torch.zeros(rows, head_dim // 2, dtype=torch.float32, device=device)
        norm_of = None if norm_width is None else torch.zeros(rows, norm_width, dtype=dtype, device=device)
        return NewTokens(qkv, cos, torch.zeros_like(cos), torch.full((rows,), -1, device=device), norm_of,
                         eps, bias)


@triton.jit
def _scaled_pair(ROW, BIAS, cols, partner_cols, mask, scale, HAS_BIAS: tl.constexpr):
    """The values at cols and at their rotation partners in fp32, scaled, plus the bias (same columns)."""
    x = tl.load(ROW + cols, mask=mask, other=0.0).to(tl.float32) * scale
    xp = tl.load(ROW + partner_cols, mask=mask, other=0.0).to(tl.float32) * scale
    if HAS_BIAS:
        x += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
        xp += tl.load(BIAS + partner_cols, mask=mask, other=0.0).to(tl.float32)
    return x, xp


@triton.jit
def _rotated(x, xp, cos, sin, first):
    """Rotate-half RoPE of x, whose partner values are xp: x1 c - x2 s in the first half, x2 c + x1 s in the
    second (rope_store's products, in its order)."""
    return x * cos + tl.where(first, -xp, xp) * sin


@triton.jit
def rope_lanes(COS_ROW, SIN_ROW, offs_d, d_mask, HALF: tl.constexpr):
    """Per head lane d (DP,): whether it is in the first half, its partner lane d +- D/2, cos and sin of
    its pair's angle."""
    first = offs_d < HALF
    pair = tl.where(first, offs_d, offs_d - HALF)
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    cos = tl.load(COS_ROW + pair, mask=d_mask, other=0.0)
    sin = tl.load(SIN_ROW + pair, mask=d_mask, other=0.0)
    return first, partner, cos, sin


@triton.jit
def rotated_q(ROW, BIAS, heads, offs_d, mask, first, partner, cos, sin, scale,
              HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(GP, DP) q heads `heads` of the qkv row at ROW, scaled, biased, rotated and rounded to its dtype."""
    base = heads[:, None] * HEAD_DIM
    x, xp = _scaled_pair(ROW, BIAS, base + offs_d[None, :], base + partner[None, :], mask, scale, HAS_BIAS)
    q = _rotated(x, xp, cos[None, :], sin[None, :], first[None, :])
    return q.to(ROW.dtype.element_ty)


@triton.jit
def store_new_kv(ROW, BIAS, K_DST, V_DST, k_col, v_col, offs_d, d_mask, first, partner, cos, sin, scale,
                 stride_kd, stride_vd, HAS_BIAS: tl.constexpr):
    """The K head at column k_col of the qkv row at ROW, scaled, biased and rotated, and the V head at v_col,
    scaled and biased, each rounded to the row's dtype and stored at K_DST / V_DST (one token's head)."""
    x, xp = _scaled_pair(ROW, BIAS, k_col + offs_d, k_col + partner, d_mask, scale, HAS_BIAS)
    k = _rotated(x, xp, cos, sin, first).to(ROW.dtype.element_ty)
    v = tl.load(ROW + v_col + offs_d, mask=d_mask, other=0.0).to(tl.float32) * scale
    if HAS_BIAS:
        v += tl.load(BIAS + v_col + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    v = v.to(ROW.dtype.element_ty)
    tl.store(K_DST + offs_d * stride_kd, k.to(K_DST.dtype.element_ty), mask=d_mask)
    tl.store(V_DST + offs_d * stride_vd, v.to(V_DST.dtype.element_ty), mask=d_mask)
