"""Torch references for the paged-decode kernels: the truth the Triton kernels are tested against.

- `paged_decode_attention_dense`: gather each sequence's K/V through its block table, materialise the
  scores, softmax in fp32 (fp64 when the inputs are fp64).
- `paged_decode_attention_tiled`: the same function computed the flash way: K/V tiles, running max m,
  running sum l, unnormalised accumulator o, rescaled by exp(m_old - m_new) whenever the max grows.
- `store_kv_reference`: write new tokens' K/V into their cache slots (slot < 0: skip).

Layout (the kernel contract in docs/ARCHITECTURE.md): q (B, Hq, D); caches (num_blocks, block_size, Hkv, D);
block_tables (B, max_blocks) int; seq_lens (B,) int. Query head h reads KV head h // (Hq // Hkv).
"""

from __future__ import annotations

import math

import torch


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def gather_kv(k_cache, v_cache, block_tables, seq_lens, dtype):
    """Gather every sequence's K/V into a padded dense tensor.

    Returns k, v (B, T, Hkv, D) and valid (B, T) bool, T = max(seq_lens) rounded up to whole blocks.
    Table entries past a sequence's length are never dereferenced (clamped to block 0 and masked).
    """
    bsz = block_tables.shape[0]
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max()) if bsz else 0
    n_blocks = max(1, -(-max_len // block_size))
    tables = block_tables[:, :n_blocks].long()                                   # (B, nb)
    if tables.shape[1] < n_blocks:
        raise ValueError(f"block_tables has {tables.shape[1]} columns, seq_lens need {n_blocks}")
    pos = torch.arange(n_blocks * block_size, device=tables.device)              # (T,)
    valid = pos[None, :] < seq_lens.long()[:, None]                              # (B, T)
    block_valid = valid.view(bsz, n_blocks, block_size)[:, :, 0]                 # (B, nb)
    tables = torch.where(block_valid, tables, torch.zeros_like(tables))
    k = k_cache[tables].to(dtype).flatten(1, 2)                                  # (B, T, Hkv, D)
    v = v_cache[tables].to(dtype).flatten(1, 2)
    return k, v, valid


def _visible(valid, seq_lens, sliding_window):
    """(B, T) mask of the keys the decode query attends to: the last `sliding_window` tokens, or all."""
    if sliding_window is None:
        return valid
    pos = torch.arange(valid.shape[1], device=valid.device)
    return valid & (pos[None, :] >= seq_lens.long()[:, None] - int(sliding_window))


def _check(q, k_cache, block_tables, seq_lens, sliding_window):
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be (B, Hq, D) and caches (N, block_size, Hkv, D); got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"head_dim mismatch: q {q.shape[2]} vs cache {k_cache.shape[3]}")
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError("block_tables and seq_lens must have one row per sequence")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def _grouped_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window):
    """Both references' set-up, in the compute dtype: (qg (B, Hkv, G, D), k and v (B, T, Hkv, D), the visible
    mask (B, T), scale); None for an empty batch."""
    _check(q, k_cache, block_tables, seq_lens, sliding_window)
    bsz, hq, d = q.shape
    if bsz == 0:
        return None
    hkv = k_cache.shape[2]
    cdt = _compute_dtype(q)
    k, v, valid = gather_kv(k_cache, v_cache, block_tables, seq_lens, cdt)
    mask = _visible(valid, seq_lens, sliding_window)
    qg = q.to(cdt).view(bsz, hkv, hq // hkv, d)
    return qg, k, v, mask, 1.0 / math.sqrt(d) if scale is None else float(scale)


def _finish(res, q, out):
    res = res.to(q.dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


def paged_decode_attention_dense(q, k_cache, v_cache, block_tables, seq_lens, scale=None,
                                 sliding_window=None, num_splits=None, backend="torch", out=None):
    """Dense reference: materialise all scores of the decode query, softmax in fp32. num_splits is moot."""
    inputs = _grouped_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
    if inputs is None:
        return _finish(q.new_zeros(q.shape, dtype=_compute_dtype(q)), q, out)
    qg, k, v, mask, scale = inputs
    s = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale                        # (B, Hkv, G, T)
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)                                          # empty rows -> zeros
    o = torch.einsum("bkgt,btkd->bkgd", p, v)                                 # (B, Hkv, G, D)
    return _finish(o.reshape(q.shape), q, out)


def online_softmax_step(m, lsum, o, s, v, rescale=True):
    """One online-softmax tile. m, lsum (..., G); o (..., G, D); s (..., G, N), -inf masked; v (..., N, D).

    rescale=False is the classic bug (update m but not lsum and o); it exists so tests can show it is caught.
    """
    m_new = torch.maximum(m, s.amax(dim=-1))                                  # (..., G)
    m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
    p = torch.exp(s - m_safe[..., None])                                      # exp(-inf) = 0
    alpha = torch.exp(m - m_safe) if rescale else torch.ones_like(m)
    lsum = lsum * alpha + p.sum(dim=-1)
    o = o * alpha[..., None] + p @ v
    return m_new, lsum, o


def paged_decode_attention_tiled(q, k_cache, v_cache, block_tables, seq_lens, scale=None,
                                 sliding_window=None, num_splits=None, backend="torch", out=None,
                                 tile=8, rescale=True):
    """Tiled online-softmax reference: keeps only m, l, o per query row; walks tiles of `tile` tokens."""
    inputs = _grouped_inputs(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
    if inputs is None:
        return _finish(q.new_zeros(q.shape, dtype=_compute_dtype(q)), q, out)
    qg, k, v, mask, scale = inputs
    qg = qg * scale                                                           # (B, Hkv, G, D)
    m = torch.full(qg.shape[:-1], float("-inf"), dtype=qg.dtype, device=q.device)  # (B, Hkv, G)
    lsum = torch.zeros_like(m)
    o = torch.zeros_like(qg)
    for start in range(0, k.shape[1], tile):
        kt = k[:, start:start + tile].permute(0, 2, 3, 1)                     # (B, Hkv, D, N)
        vt = v[:, start:start + tile].permute(0, 2, 1, 3)                     # (B, Hkv, N, D)
        s = (qg @ kt).masked_fill(~mask[:, None, None, start:start + tile], float("-inf"))
        m, lsum, o = online_softmax_step(m, lsum, o, s, vt, rescale=rescale)
    res = torch.where(lsum[..., None] > 0, o / lsum.clamp_min(1e-30)[..., None], torch.zeros_like(o))
    return _finish(res.reshape(q.shape), q, out)


def store_kv_reference(key, value, k_cache, v_cache, slot_mapping, backend="torch"):
    """k_cache[slot // bs, slot % bs] = key for every token whose slot >= 0. key/value (T, Hkv, D)."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // block_size, slots % block_size
    k_cache[blk, off] = key[keep].to(k_cache.dtype)
    v_cache[blk, off] = value[keep].to(v_cache.dtype)


def paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                      scale=None, sliding_window=None, backend="torch", out=None):
    """Varlen causal attention of prefill chunks over the paged cache, one chunk at a time, scores
    materialised, softmax in fp32 (fp64 when the inputs are fp64).

    q (T, Hq, D): chunk i is rows [qsl[i], qsl[i+1]); its n_i queries sit at positions seq_lens[i] - n_i + j
    and see keys 0..position (and, with a window W, only keys > position - W). Their K/V are in the cache.
    Rows of `out` outside [qsl[0], qsl[C]) are not written (qsl[0] may be above 0).
    """
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q must be (T, Hq, D) and caches (N, block_size, Hkv, D) with Hq % Hkv == 0; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}")
    num_chunks = seq_lens.shape[0]
    if query_start_loc.shape != (num_chunks + 1,) or block_tables.shape[0] != num_chunks:
        raise ValueError("query_start_loc must be (num_chunks + 1,), block_tables (num_chunks, max_blocks)")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    cdt = _compute_dtype(q)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    res = q.new_zeros((t, hq, d), dtype=cdt)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i in range(num_chunks):
        lo, hi, seq_len = qsl[i], qsl[i + 1], lens[i]
        n = hi - lo
        if not 0 <= n <= seq_len:
            raise ValueError(f"chunk {i}: {n} new tokens but seq_len {seq_len}")
        if n == 0:
            continue
        k, v, _ = gather_kv(k_cache, v_cache, block_tables[i : i + 1], seq_lens[i : i + 1], cdt)
        k, v = k[0, :seq_len], v[0, :seq_len]                                   # (L, Hkv, D)
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]    # (n, 1)
        k_pos = torch.arange(seq_len, device=q.device)[None, :]                 # (1, L)
        vis = k_pos <= q_pos
        if sliding_window is not None:
            vis &= k_pos > q_pos - int(sliding_window)
        qg = q[lo:hi].to(cdt).view(n, hkv, hq // hkv, d)                        # (n, Hkv, G, D)
        s = torch.einsum("nkgd,lkd->kgnl", qg, k) * scale                       # (Hkv, G, n, L)
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
        o = torch.einsum("kgnl,lkd->nkgd", p, v)                                # (n, Hkv, G, D)
        res[lo:hi] = o.reshape(n, hq, d)
    if out is None:
        return res.to(q.dtype)
    lo, hi = qsl[0], qsl[num_chunks]  # rows outside the chunks stay as they are, as in the kernel
    out[lo:hi].copy_(res[lo:hi])
    return out
