"""Paged attention for one runner step: store K/V into cache slots, then attend.

Rows [0, num_decode) of the flat batch are single-token chunks: one batched `paged_decode_attention` call.
Every longer chunk is a prefill: causal SDPA of its new queries over [its cached prefix, gathered through the
block table, + its new keys], with the causal offset start_pos (and the sliding window, if any).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from server.engine.kv_cache_tensors import KVCacheTensors
from server.model.layers import prefix_causal_attention


@dataclass
class PrefillSpan:
    start: int  # first row of the chunk in the flat batch
    end: int  # one past its last row
    start_pos: int  # tokens of the sequence already cached before this chunk
    block_ids: torch.Tensor | None  # (nb,) blocks of [0, start_pos + n); None: keys are the new rows only
    mask: torch.Tensor | None  # (n, start_pos + n) bool; None: plain causal (is_causal)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot of every new token
    num_decode: int  # decode rows come first in the flat batch
    block_tables: torch.Tensor  # (num_decode, max_blocks) int32, padded with the null block 0
    seq_lens: torch.Tensor  # (num_decode,) int32, the current token included
    prefills: list[PrefillSpan]


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
        meta = self.meta
        k_cache, v_cache = self.kv.layer(layer_idx)  # (N, bs, Hkv, D)
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=self.backend)
        if not meta.prefills:
            return self._decode(q, k_cache, v_cache)
        out = torch.empty_like(q)
        if meta.num_decode:
            self._decode(q[: meta.num_decode], k_cache, v_cache, out=out[: meta.num_decode])
        for span in meta.prefills:
            out[span.start : span.end] = self._prefill(span, q, k, v, k_cache, v_cache)
        return out

    def _decode(self, q, k_cache, v_cache, out=None) -> torch.Tensor:
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
            num_splits=self.decode_num_splits,
            backend=self.backend,
            out=out,
            workspace=ws,
        )

    def _prefill(self, span: PrefillSpan, q, k, v, k_cache, v_cache) -> torch.Tensor:
        if span.block_ids is None:
            keys, values = k[span.start : span.end], v[span.start : span.end]  # (n, Hkv, D)
        else:
            length = span.start_pos + span.end - span.start
            keys = k_cache[span.block_ids].flatten(0, 1)[:length]  # (L, Hkv, D)
            values = v_cache[span.block_ids].flatten(0, 1)[:length]
        return prefix_causal_attention(
            q[span.start : span.end], keys, values, span.start_pos, self.sliding_window, span.mask
        )
