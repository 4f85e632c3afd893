"""Paged attention for one runner step: store K/V into cache slots, then attend, one launch per kind of row.

Rows [0, num_decode) of the flat batch are single-token chunks: one batched `paged_decode_attention` call.
The rows after them are the prefill chunks, back to back: one `paged_prefill_attention` call over all of them,
reading each chunk's cached prefix and its new keys through its block table (no gathered copies, no masks).
The chunks' query_start_loc indexes the flat batch (chunk 0 starts at the first row after the decode rows),
so a captured mixed step can give the decode call more rows than it has decodes (the spare ones read
nothing) while the prefill call still finds its rows.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

import kernels
from kernels.checks import relative_error
from kernels.prefill_dispatch import paged_prefill_attention
from server.engine.kv_cache_tensors import KVCacheTensors

logger = logging.getLogger(__name__)


@dataclass
class PrefillMetadata:
    block_tables: torch.Tensor  # (C, max_blocks) int32, padded with the null block 0
    query_start_loc: torch.Tensor  # (C + 1,) int32: chunk i is rows [qsl[i], qsl[i + 1]) of the flat batch
    seq_lens: torch.Tensor  # (C,) int32: tokens of the chunk's sequence in the cache, its new ones included


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of every new token
    num_decode: int  # decode rows come first in the flat batch
    block_tables: torch.Tensor  # (num_decode, max_blocks) int32, padded with the null block 0
    seq_lens: torch.Tensor  # (num_decode,) int32, the current token included
    prefill: PrefillMetadata | None = None  # the chunks of rows [num_decode, T); None: a decode-only step


class PagedAttention:
    """The model's AttentionFn for one step (see server.model.llama.AttentionFn)."""

    def __init__(
        self,
        kv: KVCacheTensors,
        meta: AttentionMetadata,
        backend: str,
        sliding_window: int | None,
        decode_num_splits: int | None = None,  # None: the kernel's heuristic
        workspace: kernels.DecodeWorkspace | None = None,  # the runner's: KV splits merged in one launch
    ) -> None:
        self.kv, self.meta, self.backend, self.sliding_window = kv, meta, backend, sliding_window
        self.decode_num_splits, self.workspace = decode_num_splits, workspace

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q (T, Hq, D); k, v (T, Hkv, D)
        k_cache, v_cache, slots = self.kv_destination(layer_idx)
        kernels.store_kv(k, v, k_cache, v_cache, slots, backend=self.backend)
        return self.attend(layer_idx, q, k, v)

    def kv_destination(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the new tokens' K/V go: the layer's caches (N, bs, Hkv, D) and the slot mapping (T,). The
        fused decoder's RoPE kernel stores them itself and then calls `attend`."""
        k_cache, v_cache = self.kv.layer(layer_idx)
        return k_cache, v_cache, self.meta.slot_mapping

    def rope_attend(self, layer_idx: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    num_q_heads: int, norm_of: torch.Tensor | None, eps: float,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """qkv (T, (Hq + 2 Hkv) D) as projected -> the attention output (T, Hq, D): q and k rotated (after
        kernels.rope_store.rope_store_kv's row scale and bias), the new K/V stored, then attention. A
        decode-only step of up to ROPE_IN_DECODE_MAX_ROWS rows on the Triton backend does it all in the
        decode launch (kernels/new_token_rope.py) and leaves qkv as projected; any other step runs the RoPE +
        store kernel (rotating qkv in place, which the prefill kernel reads), then `attend`."""
        from kernels.new_token_rope import NewTokens  # triton
        from kernels.rope_store import rope_store_kv

        k_cache, v_cache = self.kv.layer(layer_idx)
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        heads = qkv.view(qkv.shape[0], num_q_heads + 2 * hkv, d)
        q, k, v = heads.split([num_q_heads, hkv, hkv], dim=1)  # strided views
        if ropes_in_decode_launch(self.meta, self.backend):
            new = NewTokens(qkv, cos, sin, self.meta.slot_mapping, norm_of, eps, bias)
            return self._decode(q, k_cache, v_cache, new_tokens=new)
        rope_store_kv(qkv, cos, sin, k_cache, v_cache, self.meta.slot_mapping, num_q_heads, hkv,
                      norm_of=norm_of, eps=eps, bias=bias)
        return self.attend(layer_idx, q, k, v)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the new tokens over the cache, which already holds their K/V."""
        meta = self.meta
        k_cache, v_cache = self.kv.layer(layer_idx)  # (N, bs, Hkv, D)
        if meta.prefill is None:
            return self._decode(q, k_cache, v_cache)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:  # first: in a captured mixed step its spare rows are prefill rows, zeroed here, written next
            self._decode(q[:nd], k_cache, v_cache, out=out[:nd])
        p = meta.prefill  # its query_start_loc indexes the whole flat batch
        paged_prefill_attention(q, k_cache, v_cache, p.block_tables, p.query_start_loc, p.seq_lens,
                                sliding_window=self.sliding_window, backend=self.backend, out=out, k=k, v=v)
        return out

    def _decode(self, q, k_cache, v_cache, out=None, new_tokens=None) -> torch.Tensor:
        ws = self.workspace  # sized for max_num_seqs; an eager batch beyond it merges in a second launch
        if ws is not None and q.shape[0] * k_cache.shape[2] > ws.capacity:
            ws = None
        return kernels.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            self.meta.block_tables,
            self.meta.seq_lens,
            sliding_window=self.sliding_window,
            num_splits=decode_splits(q.shape[0], k_cache, self.meta.block_tables.shape[1],
                                     self.decode_num_splits),
            backend=self.backend,
            out=out,
            workspace=ws,
            new_tokens=new_tokens,
        )


# Up to this many rows a decode-only step's RoPE + store runs inside the decode launch. Measured on an H100
# (tools/decode_forward_bench, the step with the two launches captured in the same process; docs/kernel.md):
# the one launch takes the step 2.0-2.6% under the two at 16-96 rows, ties at 128 and 192 (-0.1%, -0.4%) and
# loses at 256 (+0.9%): its prologue (the norm's row sum and RoPE before the tile loop) lengthens each of
# the attention's programs, which at 256 rows run in several waves, by more than one launch costs.
ROPE_IN_DECODE_MAX_ROWS = 128


def ropes_in_decode_launch(meta: AttentionMetadata, backend: str) -> bool:
    """Whether `rope_attend` does RoPE and the K/V store inside the decode launch: decode-only steps of up
    to ROPE_IN_DECODE_MAX_ROWS rows on the Triton backend (tools/decode_forward_bench times the separate
    RoPE + store kernel too, by replacing this)."""
    return (meta.prefill is None and backend == "triton"
            and meta.slot_mapping.shape[0] <= ROPE_IN_DECODE_MAX_ROWS
            and meta.slot_mapping.device not in _ROPE_IN_DECODE_REFUSED)


# Where the one launch disagreed at start-up with the RoPE + store kernel and the plain decode launch it
# replaces (warm_up_attention). Why a check: the fused gate_up + SiLU's first version was wrong on Hopper
# from a Triton pipelining hazard no CPU test could see (kernels/gate_up_silu.py); this launch's stores and
# the tile loop's loads of the same slot are ordered by a CTA barrier, which only the device's compiler
# and hardware can break, and a wrong attention would serve wrong tokens without an error.
_ROPE_IN_DECODE_REFUSED: set[torch.device] = set()
ROPE_IN_DECODE_TOLERANCE = 2e-2  # max abs error / max abs value; the two round alike (bitwise on the CPU)


def rope_in_decode_refused(device: torch.device) -> bool:
    """Whether the start-up check turned the one launch off on `device` (warm_up_attention)."""
    return torch.device(device) in _ROPE_IN_DECODE_REFUSED


def decode_splits(batch: int, k_cache: torch.Tensor, max_blocks: int, fixed: int | None) -> int:
    """The decode split count, always passed as a fixed count: the runner's tables are as wide as
    max_model_len (a graph's launch config must hold for any length), so the kernel's heuristic mode,
    which sizes splits from the table width, would leave every split but the first empty; a fixed count
    sizes them from each sequence's own length. `fixed` (the runner's decode_num_splits) wins; else the
    heuristic's count for this batch and table width."""
    if fixed is not None:
        return fixed
    return kernels.decode_num_splits(batch, k_cache.shape[2], max_blocks * k_cache.shape[1], k_cache.device)


def warm_up_attention(kv: KVCacheTensors, sliding_window: int | None, max_num_seqs: int, max_blocks: int,
                      num_q_heads: int, decode_num_splits: int | None,
                      workspace: kernels.DecodeWorkspace | None, new_tokens=None) -> int:
    """Compiles, before the first request, every attention kernel variant an eager step can launch: the
    decode kernel at each split count PagedAttention picks for 1..max_num_seqs rows (also, given
    new_tokens(rows) -> a NewTokens of scratch rows, its variant that rotates and stores them, for the row
    counts that take it: the fused forward's `rope_attend`), and the prefill kernel. A Triton compile
    mid-serving stalls every stream for about a second. The calls on kv read and store nothing (seq_len 0,
    padding slots, or the null block). The variant with new tokens then runs on random rows over scratch
    caches, checked against the two launches it replaces (`rope_in_decode_error`; its small caches take
    32-bit offsets, where a cache past them runs the same code on 64-bit ones): where it disagrees, decode
    steps on this device keep the two. Returns the number of decode variants."""
    k_cache, v_cache = kv.layer(0)
    d, device = k_cache.shape[3], k_cache.device
    first_batch: dict[int, int] = {}
    for batch in range(1, max_num_seqs + 1):
        first_batch.setdefault(decode_splits(batch, k_cache, max_blocks, decode_num_splits), batch)
    worst = 0.0
    for splits, batch in first_batch.items():
        q = torch.zeros(batch, num_q_heads, d, dtype=k_cache.dtype, device=device)      # (B, Hq, D)
        tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        lens = torch.zeros(batch, dtype=torch.int32, device=device)
        kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, sliding_window=sliding_window,
                                       num_splits=splits, workspace=workspace)
        if new_tokens is not None and batch <= ROPE_IN_DECODE_MAX_ROWS:
            new = new_tokens(batch)  # the variant steps launch, on this cache's layout (its offsets' width)
            kernels.paged_decode_attention(_q_heads(new.qkv, num_q_heads, d), k_cache, v_cache, tables, lens,
                                           sliding_window=sliding_window, num_splits=splits,
                                           workspace=workspace, new_tokens=new)
            worst = max(worst, rope_in_decode_error(new_tokens(batch), k_cache, max_blocks, num_q_heads,
                                                    splits, sliding_window, workspace))  # NaN-free: inf
    if not worst <= ROPE_IN_DECODE_TOLERANCE:
        _ROPE_IN_DECODE_REFUSED.add(device)
        logger.warning("the decode launch that rotates and stores its new tokens is %.2g off the RoPE + "
                       "store kernel and the plain decode launch on %s: decode steps keep the two launches "
                       "there", worst, device)
    # the prefill kernel as steps call it: q, k, v strided views of one qkv row (T=1)
    hkv = k_cache.shape[2]
    qkv = torch.zeros(1, num_q_heads + 2 * hkv, d, dtype=k_cache.dtype, device=device)
    q, k, v = qkv.split([num_q_heads, hkv, hkv], dim=1)
    tables = torch.zeros(1, max_blocks, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    paged_prefill_attention(q, k_cache, v_cache, tables, qsl, qsl[1:], sliding_window=sliding_window, k=k,
                            v=v)
    return len(first_batch)


def rope_in_decode_error(scratch, k_cache: torch.Tensor, max_blocks: int, num_q_heads: int, splits: int,
                         sliding_window: int | None, workspace: kernels.DecodeWorkspace | None) -> float:
    """The decode launch with new tokens (kernels/new_token_rope.py) against kernels.rope_store.rope_store_kv
    then the plain decode launch, on random rows shaped as `scratch` (a NewTokens of zero rows, as steps
    pass them) over scratch caches laid out as k_cache (N, bs, Hkv, D) with tables max_blocks wide: the
    largest error of the output and of the stored K/V over their largest value. Compiles the variant."""
    from kernels.rope_store import rope_store_kv

    rows, (bs, hkv, d), device = scratch.qkv.shape[0], k_cache.shape[1:], k_cache.device
    gen = torch.Generator(device=device).manual_seed(0)
    lens = torch.randint(1, min(max_blocks, 3 * splits) * bs + 1, (rows,), generator=gen, device=device)
    blocks = (lens + bs - 1) // bs
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
    ids = 1 + torch.randperm(int(blocks.sum()), generator=gen, device=device).int()  # block 0: the null block
    tables[torch.arange(max_blocks, device=device) < blocks[:, None]] = ids
    last = lens - 1
    slots = tables.gather(1, (last // bs)[:, None]).squeeze(1).long() * bs + last % bs
    caches = [torch.randn(1 + len(ids), bs, hkv, d, generator=gen, device=device).to(k_cache.dtype)
              for _ in range(2)]
    angles = torch.rand(rows, d // 2, generator=gen, device=device) * 6.3
    new = dataclasses.replace(scratch, cos=angles.cos(), sin=angles.sin(), slot_mapping=slots)
    new.qkv.copy_(torch.randn(new.qkv.shape, generator=gen, device=device))
    if new.norm_of is not None:
        new.norm_of.copy_(torch.randn(new.norm_of.shape, generator=gen, device=device))
    kw = dict(sliding_window=sliding_window, num_splits=splits, workspace=workspace, backend="triton")
    one_k, one_v = (c.clone() for c in caches)
    got = kernels.paged_decode_attention(_q_heads(new.qkv, num_q_heads, d), one_k, one_v, tables, lens.int(),
                                         new_tokens=new, **kw)
    qkv = new.qkv.clone()
    two_k, two_v = caches
    rope_store_kv(qkv, new.cos, new.sin, two_k, two_v, slots, num_q_heads, hkv, norm_of=new.norm_of,
                  eps=new.eps, bias=new.bias)
    want = kernels.paged_decode_attention(_q_heads(qkv, num_q_heads, d), two_k, two_v, tables, lens.int(),
                                          **kw)
    return max(relative_error(got, want), relative_error(one_k, two_k), relative_error(one_v, two_v))


def _q_heads(qkv: torch.Tensor, num_q_heads: int, head_dim: int) -> torch.Tensor:
    return qkv.view(qkv.shape[0], -1, head_dim)[:, :num_q_heads]  # (B, Hq, D) strided

