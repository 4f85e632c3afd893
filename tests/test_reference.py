"""The torch references: dense and tiled online softmax agree; a broken online softmax is caught."""

import math

import pytest
import torch
from kernel_cases import make_paged_case

from kernels import reference

CASES = [  # (seq_lens, Hq, Hkv, D, block_size, sliding_window)
    ([1, 7, 33, 64], 8, 2, 32, 4, None),
    ([0, 5, 100], 4, 4, 64, 16, None),
    ([257, 3], 6, 1, 80, 1, 50),
    ([300], 1, 1, 16, 256, None),
]


def _naive(case, scale=None, sliding_window=None):
    """Token-by-token loop, independent of gather_kv: fp64, one (seq, head) at a time."""
    q, k, v = case.q.double(), case.k_cache.double(), case.v_cache.double()
    bsz, hq, d = q.shape
    bs, hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(bsz):
        n = int(case.seq_lens[b])
        lo = 0 if sliding_window is None else max(0, n - sliding_window)
        toks = [(int(case.block_tables[b, t // bs]), t % bs) for t in range(lo, n)]
        for h in range(hq):
            kvh = h // (hq // hkv)
            if not toks:
                continue
            kk = torch.stack([k[blk, off, kvh] for blk, off in toks])   # (n, D)
            vv = torch.stack([v[blk, off, kvh] for blk, off in toks])
            out[b, h] = torch.softmax(kk @ q[b, h] * scale, 0) @ vv
    return out


@pytest.mark.parametrize("lens,hq,hkv,d,bs,win", CASES)
def test_dense_matches_naive_loop(lens, hq, hkv, d, bs, win):
    case = make_paged_case(lens, hq, hkv, d, bs, dtype=torch.float64, seed=len(lens) + d)
    dense = reference.paged_decode_attention_dense(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                   case.seq_lens, scale=0.3, sliding_window=win)
    torch.testing.assert_close(dense, _naive(case, 0.3, win), rtol=1e-10, atol=1e-12)


def _max_diff(tiled_kwargs, case, win):
    dense = reference.paged_decode_attention_dense(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                   case.seq_lens, sliding_window=win)
    tiled = reference.paged_decode_attention_tiled(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                   case.seq_lens, sliding_window=win, **tiled_kwargs)
    return (dense - tiled).abs().max().item()


@pytest.mark.parametrize("lens,hq,hkv,d,bs,win", CASES)
@pytest.mark.parametrize("tile", [1, 5, 64])
def test_tiled_matches_dense_fp32(lens, hq, hkv, d, bs, win, tile):
    case = make_paged_case(lens, hq, hkv, d, bs, seed=tile)
    assert _max_diff({"tile": tile}, case, win) < 2e-6


def test_broken_online_softmax_is_caught():
    """Updating m without rescaling l and o must fail the very check the tiled reference passes."""
    case = make_paged_case([40, 97], 8, 2, 64, 4, seed=3)
    case.q *= 4  # sharp distributions: the running max grows across tiles
    assert _max_diff({"tile": 8}, case, None) < 2e-6
    assert _max_diff({"tile": 8, "rescale": False}, case, None) > 1e-2


def test_zero_length_rows_are_zero_and_out_is_written():
    case = make_paged_case([0, 9], 4, 2, 32, 4)
    for fn in (reference.paged_decode_attention_dense, reference.paged_decode_attention_tiled):
        out = torch.full_like(case.q, float("nan"))
        res = fn(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, out=out)
        assert res is out and torch.isfinite(out).all()
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_fp16_output_dtype_and_fp32_math():
    case = make_paged_case([20, 33], 4, 1, 64, 16, dtype=torch.float16)
    out = reference.paged_decode_attention_dense(case.q, case.k_cache, case.v_cache, case.block_tables,
                                                 case.seq_lens)
    ref = _naive(case)
    assert out.dtype == torch.float16
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.parametrize("block_size", [1, 4, 256])
def test_store_kv_reference_writes_slots_and_skips_padding(block_size):
    num_blocks, hkv, d = 5, 2, 16
    k_cache = torch.zeros(num_blocks, block_size, hkv, d)
    v_cache = torch.zeros(num_blocks, block_size, hkv, d)
    key, value = torch.randn(4, hkv, d), torch.randn(4, hkv, d)
    slots = torch.tensor([block_size * 3, -1, block_size * 1 + block_size - 1, 0])
    reference.store_kv_reference(key, value, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // block_size, s % block_size], key[t])
            assert torch.equal(v_cache[s // block_size, s % block_size], value[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3  # the padding token wrote nothing
