"""Torch references for the fused decoder ops (kernels/rmsnorm.py, rope_store.py, activation.py, gemv.py,
splitk_add.py, gate_up_silu.py).

Each computes in fp32 and rounds once into the output dtype, as its kernel does; the one extra rounding is
the residual sum, which is stored in the residual's own dtype before it is normed (the unfused `x + h`).
"""

from __future__ import annotations

import torch


def rms_norm_reference(x, weight, eps: float, residual=None) -> torch.Tensor:
    """x (T, H) -> x * rsqrt(mean(x^2) + eps) * weight (T, H), dtype of x.

    With `residual` (T, H): residual <- residual + x (in place, rounded to residual's dtype), and the sum is
    what gets normed.
    """
    if residual is not None:
        residual.copy_(residual.float() + x.float())
        x = residual
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)  # (T, 1)
    return (xf * rstd * weight.float()).to(x.dtype)


def scaled_projection(x: torch.Tensor, norm_of=None, eps: float = 0.0, bias=None) -> torch.Tensor:
    """x (T, N) in fp32, scaled per row by rsqrt(mean(norm_of^2) + eps) (norm_of (T, H)), plus bias (N,):
    a projection of un-normed rows as the kernels finish it (a folded RMSNorm, kernels/activation.py)."""
    x = x.float()
    if norm_of is not None:
        x = x * torch.rsqrt(norm_of.float().pow(2).mean(dim=-1, keepdim=True) + eps)
    return x if bias is None else x + bias.float()


def silu_and_mul_reference(gate_up: torch.Tensor, norm_of=None, eps: float = 0.0, bias=None) -> torch.Tensor:
    """gate_up (T, 2I) = [gate | up] -> silu(gate) * up (T, I); norm_of, eps, bias as scaled_projection."""
    gate, up = scaled_projection(gate_up, norm_of, eps, bias).chunk(2, dim=-1)
    return (gate / (1.0 + torch.exp(-gate)) * up).to(gate_up.dtype)


def gate_up_silu_reference(x, weight, eps: float) -> torch.Tensor:
    """kernels.gate_up_silu.gate_up_silu as the unfused ops compute it: the product x (M, K) weight (2I, K)^T
    in fp32, rounded to x's dtype (the GEMM's output), then silu_and_mul_reference with x's row scale."""
    gate_up = (x.float() @ weight.float().T).to(x.dtype)  # (M, 2I)
    return silu_and_mul_reference(gate_up, norm_of=x, eps=eps)


def rope_store_reference(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads: int,
                         num_kv_heads: int, norm_of=None, eps: float = 0.0, bias=None) -> None:
    """Rotate q and k of qkv (T, (Hq + 2 Hkv) D) in place (rotate-half RoPE; cos/sin (T, D/2) fp32), then
    write the rotated k and v into the caches (N, block_size, Hkv, D) at slot_mapping (T,); slot < 0 skips.
    norm_of, eps, bias as scaled_projection, applied to every head first (in fp32: q and k are rounded once,
    after RoPE; v is rounded and written back in place)."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    half = d // 2
    scaled = scaled_projection(qkv, norm_of, eps, bias).view(t, num_q_heads + 2 * num_kv_heads, d)
    heads = qkv.view(t, num_q_heads + 2 * num_kv_heads, d)  # (T, Hq + 2 Hkv, D)
    heads[:, num_q_heads + num_kv_heads :] = scaled[:, num_q_heads + num_kv_heads :].to(qkv.dtype)
    qk = scaled[:, : num_q_heads + num_kv_heads]  # (T, Hq + Hkv, D) fp32
    x1, x2 = qk[..., :half], qk[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2)
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # (T, Hq + Hkv, D)
    heads[:, : num_q_heads + num_kv_heads] = rotated.to(qkv.dtype)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k = heads[keep, num_q_heads : num_q_heads + num_kv_heads]  # (T', Hkv, D)
    v = heads[keep, num_q_heads + num_kv_heads :]
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def gemv_reference(x, weight, bias=None, *, norm_weight=None, eps: float = 0.0, gated: bool = False,
                   residual=None) -> torch.Tensor:
    """kernels.gemv.gemv as the unfused ops compute it: [rms_norm ->] linear (rounded) [-> silu_and_mul]
    [-> residual += result, in place]. x (1, K), weight (N or 2N, K) -> (1, N)."""
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if gated:
        y = silu_and_mul_reference(y)
    if residual is not None:
        residual.copy_(residual.float() + y.float())
        return residual
    return y


def splitk_add_reference(residual, x, weight) -> torch.Tensor:
    """kernels.splitk_add.splitk_add: residual (M, N) += x (M, K) weight (N, K)^T in place, the product and
    the sum in fp32, rounded once (cuBLAS's addmm with beta = 1)."""
    residual.copy_(residual.float() + x.float() @ weight.float().T)
    return residual


def gemv_rope_store_reference(x, weight, bias, *, norm_weight, eps, cos, sin, k_cache, v_cache, slot_mapping,
                              num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """kernels.gemv.gemv_rope_store as the unfused ops compute it: gemv, then RoPE + store in place."""
    qkv = gemv_reference(x, weight, bias, norm_weight=norm_weight, eps=eps)
    rope_store_reference(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)
    return qkv
