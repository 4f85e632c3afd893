"""pagewalk kernels: paged-decode attention and KV store (Triton on CUDA, torch references on CPU)."""

from kernels.checks import check_block_size, check_supported
from kernels.dispatch import last_backend, paged_decode_attention, resolve_backend, store_kv
from kernels.prefill_dispatch import paged_prefill_attention
from kernels.split_heuristic import decode_num_splits
from kernels.workspace import DecodeWorkspace

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv", "last_backend", "resolve_backend",
           "DecodeWorkspace", "check_block_size", "check_supported", "decode_num_splits"]
