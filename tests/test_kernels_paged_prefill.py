"""Triton paged-prefill kernel vs the fp64 reference through the Triton interpreter on CPU; the reference vs
SDPA on contiguous K/V; the dispatch's backends and checks. `out` is poisoned with NaN before each run."""

import os

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import TOLERANCE, make_paged_case, rel_error

from kernels import reference
from kernels.prefill_dispatch import paged_prefill_attention

F32, F16 = torch.float32, torch.float16
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="the Triton kernel runs on CPU only under TRITON_INTERPRET=1")


def make_prefill_case(seq_lens, new_lens, hq, hkv, d, block_size, dtype=F32, seed=0, device="cpu"):
    """A paged case whose chunk i holds the last new_lens[i] of seq_lens[i] tokens as queries:
    -> (case, q (T, Hq, D), query_start_loc (C + 1,) int32)."""
    case = make_paged_case(seq_lens, hq, hkv, d, block_size, dtype=dtype, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(new_lens), hq, d, generator=gen).to(dtype=dtype, device=device)
    qsl = torch.tensor([0, *torch.tensor(new_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return case, q, qsl.to(device)


def reference_fp64(case, q, qsl, **kw):
    return reference.paged_prefill_attention_reference(q.double(), case.k_cache.double(),
                                                       case.v_cache.double(), case.block_tables, qsl,
                                                       case.seq_lens, **kw)


def run_triton(case, q, qsl, out=None, config=None, **kw):
    from kernels.paged_prefill import paged_prefill_attention_triton
    out = torch.full_like(q, float("nan")) if out is None else out
    res = paged_prefill_attention_triton(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens,
                                         out=out, config=config, **kw)
    assert res is out
    return out


GRID = [  # seq_lens, new tokens per chunk, Hq, Hkv, D, block_size, dtype, sliding window
    # ragged chunks: a whole prompt, a short tail over a prefix, an empty chunk, n=1, a long prefix
    ([40, 5, 0, 1, 70], [40, 3, 0, 1, 20], 8, 2, 64, 16, F32, None),
    ([33, 100], [33, 7], 4, 4, 128, 1, F16, None),                       # GQA 1, block size 1
    ([150, 9, 17], [30, 9, 1], 8, 1, 64, 128, F16, 20),                  # GQA 8, window, block size 128
    ([64, 3, 20], [10, 3, 0], 6, 2, 80, 16, F32, 5),                     # head dim 80, a group of 3
    ([1, 50, 129], [1, 1, 1], 4, 1, 64, 16, F32, None),                  # only n=1 chunks
    ([300], [45], 8, 2, 128, 128, F32, 64),                              # long prefix not block-aligned
    ([24, 24], [24, 8], 2, 1, 64, 16, F16, 1),                           # window 1: each query sees itself
]


@interpreter_only
@pytest.mark.parametrize("lens,new,hq,hkv,d,bs,dtype,win", GRID)
def test_kernel_matches_reference(lens, new, hq, hkv, d, bs, dtype, win):
    case, q, qsl = make_prefill_case(lens, new, hq, hkv, d, bs, dtype=dtype, seed=sum(lens) + d)
    out = run_triton(case, q, qsl, sliding_window=win)
    err = rel_error(out, reference_fp64(case, q, qsl, sliding_window=win))
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"


@interpreter_only
@pytest.mark.parametrize("block_m,block_n", [(16, 64), (64, 16)])
def test_tile_sizes_are_independent_of_block_size(block_m, block_n):
    from kernels.paged_prefill import PrefillConfig
    case, q, qsl = make_prefill_case([90, 37], [41, 37], 8, 2, 64, 32, seed=block_n)
    for win in (None, 23):
        out = run_triton(case, q, qsl, config=PrefillConfig(block_m, block_n, 4, 1), sliding_window=win)
        assert rel_error(out, reference_fp64(case, q, qsl, sliding_window=win)) <= 1e-5


@interpreter_only
def test_custom_scale_strided_q_and_out():
    case, q, qsl = make_prefill_case([30, 12], [20, 12], 8, 2, 32, 4, seed=3)
    q = torch.randn(q.shape[0], 8, 64)[:, :, ::2]                                  # non-contiguous q
    out = torch.full((32, 8, q.shape[0]), float("nan")).permute(2, 1, 0)           # non-contiguous out
    run_triton(case, q, qsl, out=out, scale=0.05)
    assert rel_error(out, reference_fp64(case, q, qsl, scale=0.05)) <= 1e-5


@interpreter_only
def test_empty_inputs_launch_nothing():
    case, q, qsl = make_prefill_case([5, 0], [0, 0], 4, 2, 32, 16)
    assert run_triton(case, q, qsl).shape == (0, 4, 32)
    none = torch.zeros(0, dtype=torch.int32)
    out = run_triton(type(case)(case.q, case.k_cache, case.v_cache, case.block_tables[:0], none),
                     q, torch.zeros(1, dtype=torch.int32))
    assert out.shape == (0, 4, 32)


@pytest.mark.parametrize("backend", [
    pytest.param("triton", marks=interpreter_only),
    "torch",
])
def test_chunks_offset_into_a_larger_batch_leave_other_rows_alone(backend):
    """The runner's flat batch: 5 decode rows first (qsl[0] = 5), the chunks, then padding rows and spare
    empty chunks; only the chunks' rows are written (the decode and padding rows keep their NaN)."""
    case, q, qsl = make_prefill_case([30, 9, 0, 0], [12, 9, 0, 0], 8, 2, 64, 16, seed=11)
    lead, tail = 5, 7
    big_q = torch.randn(lead + q.shape[0] + tail, 8, 64)
    big_q[lead:lead + q.shape[0]] = q
    out = torch.full_like(big_q, float("nan"))
    paged_prefill_attention(big_q, case.k_cache, case.v_cache, case.block_tables, qsl + lead, case.seq_lens,
                            backend=backend, out=out)
    assert out[:lead].isnan().all() and out[lead + q.shape[0]:].isnan().all()
    ref = reference_fp64(case, q, qsl)
    assert rel_error(out[lead:lead + q.shape[0]], ref) <= 1e-5


def test_reference_matches_sdpa_on_contiguous_kv():
    """The reference against SDPA over each chunk's K/V laid out contiguously with an explicit mask."""
    lens, new, win = [19, 7], [6, 7], 4
    case, q, qsl = make_prefill_case(lens, new, 4, 2, 16, 4, seed=9)
    ref = reference_fp64(case, q, qsl, sliding_window=win)
    for i, (length, n) in enumerate(zip(lens, new, strict=True)):
        blocks = case.block_tables[i, : -(-length // 4)].long()
        k = case.k_cache[blocks].flatten(0, 1)[:length].double()                     # (L, Hkv, D)
        v = case.v_cache[blocks].flatten(0, 1)[:length].double()
        q_pos = torch.arange(length - n, length)[:, None]
        k_pos = torch.arange(length)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - win)                               # (n, L)
        rows = q[qsl[i] : qsl[i + 1]].double()
        o = F.scaled_dot_product_attention(rows.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(ref[qsl[i] : qsl[i + 1]], o)


def test_torch_backend_is_the_reference():
    case, q, qsl = make_prefill_case([40, 9], [10, 9], 8, 2, 64, 16, seed=4)
    out = torch.full_like(q, float("nan"))
    res = paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens,
                                  sliding_window=8, backend="auto", out=out)
    assert res is out
    ref = reference.paged_prefill_attention_reference(q, case.k_cache, case.v_cache, case.block_tables, qsl,
                                                      case.seq_lens, sliding_window=8)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("change,message", [
    (dict(block_tables=lambda c: c.block_tables.long()), "block_tables must be int32"),
    (dict(qsl=lambda qsl: qsl[:-1]), r"query_start_loc \(C \+ 1,\)"),
    (dict(q=lambda q: q.half()), "must share a dtype"),
    (dict(sliding_window=0), "sliding_window must be"),
    (dict(backend="cuda"), "backend must be one of"),
])
def test_bad_inputs_raise(change, message):
    case, q, qsl = make_prefill_case([10, 4], [10, 4], 4, 2, 32, 8)
    tables = change.get("block_tables", lambda c: c.block_tables)(case)
    qsl = change.get("qsl", lambda x: x)(qsl)
    q = change.get("q", lambda x: x)(q)
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(q, case.k_cache, case.v_cache, tables, qsl, case.seq_lens,
                                sliding_window=change.get("sliding_window"),
                                backend=change.get("backend", "torch"))


BF16 = torch.bfloat16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("hq,hkv,d,bs,win", [
    (32, 8, 128, 16, None), (32, 8, 64, 16, 100), (8, 1, 64, 1, None), (6, 2, 80, 4, 100),
    (16, 16, 128, 128, None), (16, 2, 256, 32, 100), (4, 4, 96, 256, None)])
def test_gpu_grid(dtype, hq, hkv, d, bs, win):
    lens, new = [1000, 4097, 17, 1, 300, 64], [1000, 129, 17, 1, 0, 1]
    case, q, qsl = make_prefill_case(lens, new, hq, hkv, d, bs, dtype=dtype, seed=d + bs, device="cuda")
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens,
                            sliding_window=win, out=out)
    err = rel_error(out, reference_fp64(case, q, qsl, sliding_window=win))
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_many_small_chunks():
    """The prefix-cache-hit step: 32 chunks x 16 new tokens over 496 cached each, bf16."""
    case, q, qsl = make_prefill_case([512] * 32, [16] * 32, 32, 8, 128, 16, dtype=BF16, device="cuda")
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, out=out)
    assert rel_error(out, reference_fp64(case, q, qsl)) <= TOLERANCE[BF16]
