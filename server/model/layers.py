"""Decoder building blocks: RMSNorm, the SwiGLU MLP, dense causal attention (the contiguous path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (T, H). One fused op on CUDA; fp32 accumulation. Bitwise equal to transformers' formula in fp32;
        # in bf16/fp16 it rounds once after the weight multiply instead of once before it.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None = None
) -> torch.Tensor:
    """Dense causal attention of ONE contiguous sequence. q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D)."""
    n, num_heads = q.shape[0], q.shape[1]
    mask = None if sliding_window is None else causal_mask(n, 0, sliding_window, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # (1, Hq, T, D): 4-D so the fused CUDA kernels are eligible
        k.transpose(0, 1)[None],  # (1, Hkv, T, D)
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=num_heads != k.shape[1],
    )  # (1, Hq, T, D)
    return out[0].transpose(0, 1)


def causal_mask(n: int, start_pos: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """(n, start_pos + n) bool: query i (position start_pos + i) sees key j iff j <= start_pos + i (and within
    the last `sliding_window` positions, itself included)."""
    q_pos = torch.arange(start_pos, start_pos + n, device=device)[:, None]  # (n, 1)
    k_pos = torch.arange(start_pos + n, device=device)[None, :]  # (1, L)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask
