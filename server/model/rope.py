"""Rotary position embedding (rotate-half layout, as in transformers' Llama), incl. llama3 scaling."""

from __future__ import annotations

import math

import torch

from server.model.config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """(D/2,) fp32 inverse frequencies, computed exactly as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for a flat batch of positions once per forward; every layer reuses them."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `module.to(bfloat16)` must never round the frequencies.
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)  # (D/2,) fp32

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (T,) -> cos, sin (T, 1, D) in `dtype`, broadcastable over heads
        cos, sin = self.half_angles(positions)  # (T, D/2): both halves of a head share the angles
        return (torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
                torch.cat((sin, sin), dim=-1).to(dtype)[:, None, :])

    def half_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (T,) -> cos, sin (T, D/2) fp32 of pair i's angle position * inv_freq[i]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (T, H, D); cos/sin (T, 1, D)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
