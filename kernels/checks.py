"""What the kernels accept: dtypes, head dims, block sizes, and the shape checks of a decode call.

The one home of these rules: the dispatch, the Triton wrappers and the runner all call them, so a message
never promises what a check does not test.
"""

from __future__ import annotations

import math

import torch

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TORCH_DTYPES = TRITON_DTYPES + (torch.float64,)
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 256


def check_block_size(block_size: int) -> None:
    """ValueError unless block_size is a power of two from 1 to MAX_BLOCK_SIZE (the kernels index a token's
    block with a shift and mask, and a tile spans whole blocks or divides one)."""
    if (not isinstance(block_size, int) or isinstance(block_size, bool)
            or not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two from 1 to {MAX_BLOCK_SIZE}, got {block_size!r}")


def check_supported(backend: str, dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    """ValueError naming what `backend` supports unless it takes this dtype, head_dim and block size."""
    dtypes = TRITON_DTYPES if backend == "triton" else TORCH_DTYPES
    if dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{backend} backend supports dtypes {{{names}}}, got {dtype}")
    if backend == "triton" and (head_dim % 16 != 0 or not 16 <= head_dim <= MAX_HEAD_DIM):
        raise ValueError(f"triton backend supports head_dim in multiples of 16 from 16 to {MAX_HEAD_DIM}, "
                         f"got {head_dim}")
    check_block_size(int(block_size))


def check_attention_inputs(backend: str, q, k_cache, v_cache, index_tensors, out) -> None:
    """What every attention call needs, decode or prefill: a supported dtype, head_dim and block size; one
    dtype for q and both caches; q (rows, Hq, D), caches (N, bs, Hkv, D) with Hq % Hkv == 0; the index
    tensors on q's device; `out` (if given) shaped, typed and placed like q."""
    check_supported(backend, q.dtype, q.shape[-1], k_cache.shape[1])
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache, v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be (rows, Hq, D) and k_cache (N, block_size, Hkv, D); got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv, dk = k_cache.shape[2], k_cache.shape[3]
    if hkv < 1 or hq % hkv or dk != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)} (need Hq % Hkv == 0, same head_dim)")
    devices = {t.device for t in (q, k_cache, v_cache, *index_tensors)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}")


def check_decode_inputs(backend: str, q, k_cache, v_cache, block_tables, seq_lens, out) -> None:
    """check_attention_inputs, plus block_tables (B, nb) and seq_lens (B,) of int32/int64."""
    check_attention_inputs(backend, q, k_cache, v_cache, (block_tables, seq_lens), out)
    bsz = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or seq_lens.shape != (bsz,):
        raise ValueError("block_tables must be (B, max_blocks) and seq_lens (B,)")
    ints = (torch.int32, torch.int64)
    if block_tables.dtype not in ints or seq_lens.dtype not in ints:
        raise ValueError("block_tables and seq_lens must be int32 or int64")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in fp32, inf where either holds a NaN (which Python's max() would drop):
    what the start-up checks of the fused kernels compare with their unfused twins."""
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    return math.inf if math.isnan(err) else err
