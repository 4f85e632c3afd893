"""The paged KV cache as tensors: one allocation, viewed per layer as k/v [num_blocks, block_size, Hkv, D]."""

from __future__ import annotations

import torch


class KVCacheTensors:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        # (L, 2, N, bs, Hkv, D); zeros so that the null block 0 and never-written slots hold finite values
        self.data = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k_cache, v_cache (N, bs, Hkv, D)
        return self.data[layer_idx, 0], self.data[layer_idx, 1]

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """pairs (Q, 2) device ints (src, dst): dst <- src, all layers, K and V (sources read before any
        write)."""
        src, dst = pairs.long().unbind(1)
        self.data[:, :, dst] = self.data[:, :, src]
