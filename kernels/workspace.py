"""Caller-owned scratch for paged-decode attention: arrival counters for the in-launch split merge.

With several KV splits, the splits' partial outputs must be merged by their log-sum-exp. Without a workspace
a second launch (stage 2) merges them. With one, each split program increments the counter of its (sequence,
KV head) after writing its partial; the program that draws the last ticket merges all splits and sets the
counter back to 0 before the launch ends. So the counters are zeroed once, here, and never per call (a
per-call memset is a launch of its own, which costs more than the second launch it saves).

The caller owns the memory (the kernel allocates nothing persistent), as with FlashInfer's workspace buffers.
Rule of use: launches that may run at the same time (different streams) must not share a workspace; launches
on one stream, or replays of CUDA graphs on one stream, run in order and may.
"""

from __future__ import annotations

import torch


class DecodeWorkspace:
    """Counters for up to `max_seqs` sequences of `num_kv_heads` KV heads on `device`, all zero."""

    def __init__(self, max_seqs: int, num_kv_heads: int, device) -> None:
        if max_seqs < 1 or num_kv_heads < 1:
            raise ValueError(f"max_seqs and num_kv_heads must be >= 1, got {max_seqs}, {num_kv_heads}")
        self.capacity = max_seqs * num_kv_heads         # (sequence, KV head) pairs one launch may use
        self.tickets = torch.zeros(self.capacity, dtype=torch.int32, device=device)  # (capacity,)
        self.device = self.tickets.device
        self.device_index = self.tickets.get_device()   # -1 on the CPU, as torch.Tensor.get_device says

    def check(self, q: torch.Tensor, num_kv_heads: int) -> None:
        """ValueError unless this workspace can serve a decode call with these queries (B, Hq, D)."""
        need = q.shape[0] * num_kv_heads
        if need > self.capacity:
            raise ValueError(f"workspace holds {self.capacity} (sequence, KV head) counters, the call needs "
                             f"{need} ({q.shape[0]} sequences x {num_kv_heads} KV heads)")
        if self.device != q.device:
            raise ValueError(f"workspace is on {self.device}, the queries on {q.device}")

    def idle(self) -> bool:
        """True when every counter is back at zero (no launch in flight left one behind); syncs the device."""
        return not bool(self.tickets.any())
