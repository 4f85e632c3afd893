"""Backend dispatch: which implementation runs, checked up front and reported, never silently swapped.

CUDA tensors take the Triton kernels for "auto"; CPU tensors take the torch references, unless the caller
asks for backend="triton" with TRITON_INTERPRET=1 set, which runs the real kernels in Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kernels import reference
from kernels.checks import check_decode_inputs, check_supported

BACKENDS = ("auto", "triton", "torch")

_last_backend = "none"
_paged_decode_triton = None


def last_backend() -> str:
    """The backend the last paged_decode_attention / store_kv call actually ran ("none" before any)."""
    return _last_backend


# found without importing it (an import costs CPU-only users ~1 s); resolve_backend and the CUDA hot path
# both read this one answer
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(device, requested: str = "auto") -> str:
    """What would run on `device`: "triton" or "torch". ValueError if `requested` is impossible."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    dev = torch.device(device)
    if requested == "torch":
        return "torch"
    if dev.type == "cuda":
        if not _TRITON_AVAILABLE:
            if requested == "triton":
                raise ValueError("backend='triton' needs the triton package, which is not installed")
            return "torch"
        return "triton"
    if requested == "auto":
        return "torch"
    if not _TRITON_AVAILABLE:
        raise ValueError("backend='triton' needs the triton package, which is not installed")
    if not _interpreter_on():
        raise ValueError(f"backend='triton' on {dev.type} tensors needs TRITON_INTERPRET=1 "
                         "(the Triton interpreter); use backend='torch' or 'auto' instead")
    return "triton"


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, sliding_window=None,
                           num_splits=None, backend="auto", out=None, workspace=None, new_tokens=None):
    """Decode attention over a paged KV cache. q (B, Hq, D) -> (B, Hq, D); docs/ARCHITECTURE.md has the
    kernel contract.

    workspace: an optional caller-owned kernels.DecodeWorkspace; the Triton kernel then merges KV splits
    inside its one launch (kernels/workspace.py says when one may be shared). The torch backend needs none.
    new_tokens: an optional kernels.new_token_rope.NewTokens: q is then the q heads of its qkv rows as
    projected, and the call first rotates q and k and stores the new tokens' K/V (RoPE + store); the Triton
    kernel does both in its one launch and leaves qkv as it is.

    The Triton wrapper checks its own inputs once per call signature, so the CUDA hot path goes straight
    there; reference.paged_decode_attention_dense is the torch backend.
    """
    global _last_backend
    if backend == "auto" and q.is_cuda and _TRITON_AVAILABLE:
        chosen = "triton"
    else:
        chosen = resolve_backend(q.device, backend)
    if chosen == "triton":
        res = _triton_decode()(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                               sliding_window=sliding_window, num_splits=num_splits, out=out,
                               workspace=workspace, new_tokens=new_tokens)
    else:
        check_decode_inputs(chosen, q, k_cache, v_cache, block_tables, seq_lens, out)
        if new_tokens is not None:
            new_tokens.check(q, k_cache, v_cache)
            q = new_tokens.reference_query(k_cache, v_cache, q.shape[1])
        res = reference.paged_decode_attention_dense(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                                     sliding_window=sliding_window, out=out)
    _last_backend = chosen
    return res


def _triton_decode():
    """kernels.paged_decode imported on first use (it imports triton, which CPU-only callers may lack)."""
    global _paged_decode_triton
    if _paged_decode_triton is None:
        from kernels.paged_decode import paged_decode_attention_triton
        _paged_decode_triton = paged_decode_attention_triton
    return _paged_decode_triton


def store_kv(key, value, k_cache, v_cache, slot_mapping, backend="auto"):
    """Write key/value (T, Hkv, D) into cache slots (slot = block_id * block_size + offset; < 0 skips)."""
    global _last_backend
    chosen = resolve_backend(key.device, backend)
    check_supported(chosen, k_cache.dtype, k_cache.shape[-1], k_cache.shape[1])
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"key/value must be (T, Hkv, D) matching caches {tuple(k_cache.shape)}; "
                         f"got {tuple(key.shape)}, {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be ({key.shape[0]},), got {tuple(slot_mapping.shape)}")
    if chosen == "triton":
        from kernels.kv_store import store_kv_triton
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
    _last_backend = chosen
