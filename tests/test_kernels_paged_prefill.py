"""Triton paged-prefill kernel vs the fp64 reference through the Triton interpreter on CPU; the reference vs
SDPA on contiguous K/V; the dispatch's backends and checks. `out` is poisoned with NaN before each run."""

import dataclasses
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


def new_kv_rows(case, q, qsl, hq, wide=True):
    """The chunks' new tokens' K/V gathered from the cache as the qkv projection holds them: (T, Hkv, D)
    strided views of one (T, (Hq + 2 Hkv) D) tensor (wide=False: contiguous tensors). Their cache slots are
    then poisoned with NaN, so a kernel that reads the new keys through the block table fails."""
    t, (hkv, d) = q.shape[0], case.k_cache.shape[2:]
    rows = torch.randn(t, hq + 2 * hkv, d, dtype=q.dtype, device=q.device)
    k, v = rows[:, hq:hq + hkv], rows[:, hq + hkv:]
    bs = case.k_cache.shape[1]
    tables, lens, starts = case.block_tables.tolist(), case.seq_lens.tolist(), qsl.tolist()
    r, blk, off = [], [], []
    for i, (lo, hi) in enumerate(zip(starts, starts[1:], strict=False)):
        for row, pos in zip(range(lo, hi), range(lens[i] - (hi - lo), lens[i]), strict=True):
            r.append(row)
            blk.append(tables[i][pos // bs])
            off.append(pos % bs)
    r, blk, off = (torch.tensor(x, dtype=torch.long, device=q.device) for x in (r, blk, off))
    k[r], v[r] = case.k_cache[blk, off], case.v_cache[blk, off]
    case.k_cache[blk, off] = float("nan")
    case.v_cache[blk, off] = float("nan")
    return (k, v) if wide else (k.contiguous(), v.contiguous())


@interpreter_only
@pytest.mark.parametrize("lens,new,hq,hkv,d,bs,dtype,win", GRID)
@pytest.mark.parametrize("pack_group", [True, False])
def test_kernel_reads_the_new_keys_from_their_rows(lens, new, hq, hkv, d, bs, dtype, win, pack_group):
    """With the new tokens' K/V rows passed, the chunks' own keys come from them (their cache slots hold NaN)
    and the prefix from the cache; head dim 80 (no tensor descriptor) reads everything from the cache, so
    there the rows are passed but the cache keeps its keys."""
    from kernels.paged_prefill import INTERPRETER_CONFIG, takes_new_kv
    case, q, qsl = make_prefill_case(lens, new, hq, hkv, d, bs, dtype=dtype, seed=sum(lens) + d)
    ref = reference_fp64(case, q, qsl, sliding_window=win)
    if not takes_new_kv(case.k_cache[0], case.v_cache[0]):  # D 80
        k, v = torch.zeros(q.shape[0], hkv, d, dtype=dtype), torch.zeros(q.shape[0], hkv, d, dtype=dtype)
    else:
        k, v = new_kv_rows(case, q, qsl, hq, wide=bs != 1)
    cfg = dataclasses.replace(INTERPRETER_CONFIG, pack_group=pack_group)
    out = run_triton(case, q, qsl, sliding_window=win, k=k, v=v, config=cfg)
    err = rel_error(out, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"


@interpreter_only
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_new_kv_rows_past_the_chunks_do_not_reach_the_output(poison):
    """The last chunk's diagonal tile reads BLOCK_N new-K/V rows, past its last token into the padding rows
    of a captured step (whatever the previous layer left there): their weight is 0 and a NaN / inf there
    must not turn it into NaN."""
    case, q, qsl = make_prefill_case([58, 5], [37, 5], 8, 2, 64, 16, seed=11)
    hi = q.shape[0]
    padded = torch.cat([q, torch.randn(20, 8, 64)])  # 20 padding rows after qsl[C]
    ref = reference_fp64(case, q, qsl)
    k, v = new_kv_rows(case, padded, qsl, 8)
    k[hi:], v[hi:] = poison, poison
    out = run_triton(case, padded, qsl, k=k, v=v)
    assert rel_error(out[:hi], ref) <= 1e-5


@interpreter_only
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_chunks_new_kv_rows_do_not_reach_the_chunk_before(poison):
    """Chunk 0's last tiles read BLOCK_N new-K/V rows, past its last token into chunk 1's rows: a NaN / inf
    there (chunk 1's own trouble) leaves chunk 0's output exact."""
    case, q, qsl = make_prefill_case([45, 30], [45, 30], 8, 2, 64, 16, seed=13)
    ref = reference_fp64(case, q, qsl)
    k, v = new_kv_rows(case, q, qsl, 8)
    first_end = int(qsl[1])
    k[first_end:], v[first_end:] = poison, poison
    out = run_triton(case, q, qsl, k=k, v=v)
    assert rel_error(out[:first_end], ref[:first_end]) <= 1e-5


def test_a_scale_that_is_not_positive_is_refused():
    case, q, qsl = make_prefill_case([30], [10], 8, 2, 32, 16, seed=5)
    with pytest.raises(ValueError, match="scale"):
        run_triton(case, q, qsl, scale=-3.0)


@interpreter_only
@pytest.mark.parametrize("block_m,block_n", [(16, 64), (64, 16)])
def test_tile_sizes_are_independent_of_block_size(block_m, block_n):
    from kernels.paged_prefill import PrefillConfig
    case, q, qsl = make_prefill_case([90, 37], [41, 37], 8, 2, 64, 32, seed=block_n)
    refs = {win: reference_fp64(case, q, qsl, sliding_window=win) for win in (None, 23)}
    for win in (None, 23):
        out = run_triton(case, q, qsl, config=PrefillConfig(block_m, block_n, 4, 1), sliding_window=win)
        assert rel_error(out, refs[win]) <= 1e-5
    k, v = new_kv_rows(case, q, qsl, 8)
    for win in (None, 23):
        for pack in (True, False):
            cfg = PrefillConfig(block_m, block_n, 4, 1, pack_group=pack)
            out = run_triton(case, q, qsl, config=cfg, sliding_window=win, k=k, v=v)
            assert rel_error(out, refs[win]) <= 1e-5, (win, pack)


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
    # the new K/V rows of the same flat batch: row lead + r holds chunk row r's key
    k, v = new_kv_rows(case, q, qsl, 8)
    big_k, big_v = (torch.cat([torch.randn(lead, *x.shape[1:]), x, torch.randn(tail, *x.shape[1:])])
                    for x in (k, v))
    out = torch.full_like(big_q, float("nan"))
    paged_prefill_attention(big_q, case.k_cache, case.v_cache, case.block_tables, qsl + lead, case.seq_lens,
                            backend=backend, out=out, k=big_k, v=big_v)
    assert out[:lead].isnan().all() and out[lead + q.shape[0]:].isnan().all()
    if backend == "triton":  # (the reference reads the cache, whose new slots new_kv_rows poisoned)
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
    (dict(kv=lambda k, v: (k, None)), "k and v .* go together"),
    (dict(kv=lambda k, v: (k[1:], v[1:])), r"k must be \(14, 2, 32\)"),
    (dict(kv=lambda k, v: (k, v.half())), "v must be"),
])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreter_only)])
def test_bad_inputs_raise(change, message, backend):
    case, q, qsl = make_prefill_case([10, 4], [10, 4], 4, 2, 32, 8)
    tables = change.get("block_tables", lambda c: c.block_tables)(case)
    qsl = change.get("qsl", lambda x: x)(qsl)
    q = change.get("q", lambda x: x)(q)
    k, v = change.get("kv", lambda k, v: (None, None))(torch.zeros(14, 2, 32), torch.zeros(14, 2, 32))
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(q, case.k_cache, case.v_cache, tables, qsl, case.seq_lens,
                                sliding_window=change.get("sliding_window"),
                                backend=change.get("backend", backend), k=k, v=v)


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
    ref = reference_fp64(case, q, qsl, sliding_window=win)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens,
                            sliding_window=win, out=out)
    err = rel_error(out, ref)
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"
    k, v = new_kv_rows(case, q, qsl, hq)  # poisons the cache's new slots
    if d in (64, 128, 256):   # tensor descriptors read the new keys; else the poisoned cache would show
        out = torch.full_like(q, float("nan"))
        paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens,
                                sliding_window=win, out=out, k=k, v=v)
        err = rel_error(out, ref)
        assert err <= TOLERANCE[dtype], f"new K/V rows: relative error {err:.2e}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_many_small_chunks():
    """The prefix-cache-hit step: 32 chunks x 16 new tokens over 496 cached each, bf16."""
    case, q, qsl = make_prefill_case([512] * 32, [16] * 32, 32, 8, 128, 16, dtype=BF16, device="cuda")
    ref = reference_fp64(case, q, qsl)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, out=out)
    assert rel_error(out, ref) <= TOLERANCE[BF16]
    k, v = new_kv_rows(case, q, qsl, 32)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, out=out,
                            k=k, v=v)
    assert rel_error(out, ref) <= TOLERANCE[BF16]


@pytest.mark.gpu
@needs_cuda
def test_gpu_new_kv_rows_of_one_token_and_the_direct_launch():
    """A one-row step (tensor descriptors over one row, tiles past it zero-filled), then the cached direct
    launch of the same specialisation on new data."""
    for lens, new in (([1], [1]), ([37, 300], [37, 45])):
        case, q, qsl = make_prefill_case(lens, new, 32, 8, 128, 16, dtype=BF16, seed=len(lens), device="cuda")
        ref = reference_fp64(case, q, qsl)
        k, v = new_kv_rows(case, q, qsl, 32)
        for _ in range(2):
            out = torch.full_like(q, float("nan"))
            paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens,
                                    out=out, k=k, v=v)
            assert rel_error(out, ref) <= TOLERANCE[BF16], lens
