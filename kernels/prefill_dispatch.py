"""paged_prefill_attention: the public entry for prefill chunks over the paged cache; backend chosen as for
decode (kernels.dispatch.resolve_backend): CUDA takes the Triton kernel, CPU the torch reference unless
backend="triton" with TRITON_INTERPRET=1."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.checks import check_attention_inputs
from kernels.dispatch import resolve_backend

_paged_prefill_triton = None


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale=None,
                            sliding_window=None, backend="auto", out=None, k=None, v=None):
    """Causal attention of prefill chunks through their block tables: q (T, Hq, D) -> (T, Hq, D).

    Chunk i is rows [query_start_loc[i], query_start_loc[i + 1]) of q; its queries are the last n_i of the
    seq_lens[i] tokens of its sequence in the cache (their K/V already stored). query_start_loc[0] may be
    above 0; rows of `out` outside [qsl[0], qsl[C]) are not written. block_tables (C, max_blocks)
    int32, query_start_loc (C + 1,) int32, seq_lens (C,) int32, all on q's device.
    k, v (T, Hkv, D), optional: the same new tokens' K/V rows as stored (row r of k is the key of q's row r;
    strided views of the qkv projection's output do). The Triton kernel then reads each chunk's own keys
    from them where their layout allows tensor-memory copies, and only the cached prefix through the block
    table; the result is the same (the reference reads the cache).
    """
    chosen = resolve_backend(q.device, backend)
    if chosen == "triton":
        return _triton_prefill()(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale=scale,
                                 sliding_window=sliding_window, out=out, k=k, v=v)
    check_prefill_inputs(chosen, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
                         sliding_window, k, v)
    return reference.paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, query_start_loc,
                                                       seq_lens, scale=scale, sliding_window=sliding_window,
                                                       out=out)


def check_prefill_inputs(backend, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
                         sliding_window, k=None, v=None) -> None:
    """ValueError unless `backend` takes this call: kernels.checks.check_attention_inputs, plus C chunks
    described by int32 block_tables (C, nb), query_start_loc (C + 1,) and seq_lens (C,), and the new K/V rows
    k, v (T, Hkv, D) of the cache's dtype on q's device, both or neither.
    The chunks' contents (n_i <= seq_lens[i], query_start_loc[C] == T) are the caller's contract: checking
    them would cost a device sync."""
    check_attention_inputs(backend, q, k_cache, v_cache, (block_tables, query_start_loc, seq_lens), out)
    num_chunks = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if (num_chunks < 0 or query_start_loc.shape != (num_chunks + 1,) or block_tables.dim() != 2
            or block_tables.shape[0] != num_chunks):
        raise ValueError(f"need seq_lens (C,), query_start_loc (C + 1,), block_tables (C, max_blocks); got "
                         f"{tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}, "
                         f"{tuple(block_tables.shape)}")
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("query_start_loc and seq_lens must be contiguous")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens' K/V rows) go together: pass both or neither")
    if k is not None:
        want = (q.shape[0], k_cache.shape[2], k_cache.shape[3])
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != want or x.dtype != k_cache.dtype or x.device != q.device:
                raise ValueError(f"{name} must be {want} {k_cache.dtype} on {q.device}, got "
                                 f"{tuple(x.shape)} {x.dtype} on {x.device}")


def _triton_prefill():
    """kernels.paged_prefill imported on first use (it imports triton, which CPU-only callers may lack)."""
    global _paged_prefill_triton
    if _paged_prefill_triton is None:
        from kernels.paged_prefill import paged_prefill_attention_triton
        _paged_prefill_triton = paged_prefill_attention_triton
    return _paged_prefill_triton
