"""tools/compile_forward_probe's CPU half: the torch decoder ops traced whole (fullgraph) with the K/V store +
paged decode attention as one torch.library custom op, whose fake and real implementations agree, give the
eager modules' logits; and the op itself stores the new K/V where the runner's store does."""

from __future__ import annotations

import torch

import kernels
from tools import compile_forward_probe as probe


def test_fullgraph_trace_equals_the_eager_modules():
    probe.smoke()  # asserts the traced step's logits equal the eager ones (rel err < 1e-5)


def test_the_custom_op_stores_then_attends():
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, d, bs, nblocks = 3, 4, 2, 16, 4, 8
    kv_data = torch.randn(2, 2, nblocks, bs, hkv, d, generator=gen)  # (L, 2, N, bs, Hkv, D); layer 1 used
    k_cache, v_cache = kv_data[1, 0], kv_data[1, 1]
    q, k, v = (torch.randn(b, h, d, generator=gen) for h in (hq, hkv, hkv))
    tables = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    lens = torch.tensor([5, 8, 1], dtype=torch.int32)
    last = [n - 1 for n in lens.tolist()]  # the new token's position in each sequence
    slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for i, p in enumerate(last)])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kernels.store_kv(k, v, ref_k, ref_v, slots)
    ref = kernels.paged_decode_attention(q, ref_k, ref_v, tables, lens, num_splits=1)
    layer0 = kv_data[0].clone()
    out = torch.ops.pagewalk_probe.store_and_attend(q, k, v, kv_data, 1, slots, tables, lens, 1)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v) and torch.equal(kv_data[0], layer0)
    torch.testing.assert_close(out, ref)
    assert out.is_contiguous() and out.shape == q.shape
