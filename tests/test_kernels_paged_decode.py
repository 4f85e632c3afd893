"""Triton paged-decode kernel vs the fp64 reference, run through the Triton interpreter on CPU.

The grid covers every value of each axis (batch 1..8, Hq/Hkv, head_dim, block_size, splits, dtype,
sliding window, strides) without the full cartesian product. `out` is poisoned with NaN before each run.
"""

import os

import pytest
import torch
from kernel_cases import TOLERANCE, make_paged_case, reference_fp64, rel_error

import kernels
from kernels.split_heuristic import KernelConfig

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernel runs on CPU only under TRITON_INTERPRET=1")

F32, F16 = torch.float32, torch.float16
GRID = [  # seq_lens, Hq, Hkv, D, block_size, num_splits, dtype, sliding_window, strided caches
    ([0, 1, 37, 64], 1, 1, 32, 1, None, F32, None, False),
    ([130], 4, 4, 64, 4, 1, F16, None, True),
    ([5, 0, 300, 17, 1, 64], 8, 2, 80, 16, 3, F32, 40, False),
    ([513, 2], 6, 1, 128, 256, None, F16, None, False),
    ([1, 2, 3, 4, 5, 6, 7, 8], 8, 2, 32, 256, 1, F32, None, True),
    ([200, 77, 0], 6, 1, 64, 1, 3, F16, 9, False),
    ([96, 33], 4, 4, 128, 16, None, F32, None, True),
    ([45, 300, 1, 0, 12], 1, 1, 80, 4, 3, F16, None, False),
    # beyond the grid: head_dim 96/256, block sizes 2/8/128, a window over a long ragged batch
    ([3, 0, 129, 64, 255, 1, 77, 500], 8, 2, 96, 8, None, F16, 100, True),
    ([260, 31], 4, 1, 256, 128, 3, F32, None, False),
    ([1000], 6, 1, 64, 2, None, F32, 333, False),
]


def _run(case, **kw):
    out = torch.full_like(case.q, float("nan"))
    res = kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                         case.seq_lens, backend="triton", out=out, **kw)
    assert res is out and kernels.last_backend() == "triton"
    return out


@pytest.mark.parametrize("lens,hq,hkv,d,bs,splits,dtype,win,strided", GRID)
def test_kernel_matches_reference(lens, hq, hkv, d, bs, splits, dtype, win, strided):
    case = make_paged_case(lens, hq, hkv, d, bs, dtype=dtype, seed=sum(lens) + d, strided=strided)
    out = _run(case, num_splits=splits, sliding_window=win)
    err = rel_error(out, reference_fp64(case, sliding_window=win))
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"
    zero_rows = [i for i, n in enumerate(lens) if n == 0]
    assert all(torch.equal(out[i], torch.zeros_like(out[i])) for i in zero_rows)


@pytest.mark.parametrize("block_n", [16, 64])
def test_tile_width_is_independent_of_block_size(block_n):
    from kernels.paged_decode import paged_decode_attention_triton
    case = make_paged_case([150, 61], 8, 2, 64, 32, seed=block_n)
    out = torch.full_like(case.q, float("nan"))
    paged_decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  num_splits=2, out=out, config=KernelConfig(block_n, 4, 1))
    assert rel_error(out, reference_fp64(case)) <= 1e-5


def test_custom_scale_and_strided_q_and_out():
    case = make_paged_case([70, 20], 8, 2, 32, 4, seed=5)
    q_wide = torch.randn(2, 8, 64)
    case.q = q_wide[:, :, ::2]                                    # non-contiguous q
    out_t = torch.full((32, 8, 2), float("nan")).permute(2, 1, 0)  # non-contiguous out (2, 8, 32)
    kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   scale=0.05, num_splits=3, backend="triton", out=out_t)
    assert rel_error(out_t, reference_fp64(case, scale=0.05)) <= 1e-5


def test_batch_invariance_with_fixed_splits():
    """With num_splits fixed, a sequence's output is bitwise the same whatever else is in the batch."""
    big = make_paged_case([90, 333, 7], 8, 2, 64, 16, seed=11)
    solo = make_paged_case([333], 8, 2, 64, 16, seed=12)
    solo.q, solo.k_cache, solo.v_cache = big.q[1:2].clone(), big.k_cache, big.v_cache
    solo.block_tables = big.block_tables[1:2].clone()
    for splits in (1, 3):
        together = _run(big, num_splits=splits)
        alone = _run(solo, num_splits=splits)
        assert torch.equal(together[1], alone[0])


def test_all_empty_sequences_give_zeros():
    case = make_paged_case([0, 0], 4, 2, 32, 16)
    for splits in (None, 1, 3):
        assert torch.equal(_run(case, num_splits=splits), torch.zeros_like(case.q))


@pytest.mark.parametrize("dtype,d,match", [(torch.float64, 64, "dtypes"), (torch.float32, 72, "head_dim"),
                                           (torch.int32, 64, "dtypes")])
def test_unsupported_inputs_raise(dtype, d, match):
    case = make_paged_case([4], 2, 2, d, 4)
    q, k, v = case.q.to(dtype), case.k_cache.to(dtype), case.v_cache.to(dtype)
    with pytest.raises(ValueError, match=match):
        kernels.paged_decode_attention(q, k, v, case.block_tables, case.seq_lens, backend="triton")


def test_bad_arguments_raise():
    case = make_paged_case([4], 6, 4, 32, 4)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                       case.seq_lens, backend="torch")
    with pytest.raises(ValueError, match="Hq % Hkv"):  # no KV head at all: not a division by zero
        kernels.paged_decode_attention(case.q, case.k_cache[:, :, :0], case.v_cache[:, :, :0],
                                       case.block_tables, case.seq_lens, backend="torch")
    case = make_paged_case([4], 4, 2, 32, 4)
    with pytest.raises(ValueError, match="num_splits"):
        kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                       case.seq_lens, num_splits=0, backend="triton")
    case = make_paged_case([40, 17], 4, 2, 32, 4)
    wide = torch.zeros(2, 2 * case.block_tables.shape[1], dtype=case.block_tables.dtype)
    wide[:, ::2] = case.block_tables  # the same entries, every other column: the kernel read them by 1
    with pytest.raises(ValueError, match="contiguous"):
        kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, wide[:, ::2], case.seq_lens,
                                       backend="triton")


@pytest.mark.parametrize("splits", [2, 5, 40])
def test_workspace_merge_agrees_with_two_launch_merge(splits):
    """With a DecodeWorkspace the last split program of each (seq, kv_head) merges in the same launch; it
    agrees with the stage-2 launch, and it leaves every counter at zero (a stale count would break the next
    launch, which the third call checks: same output bitwise). 40 splits take the merge's chunk loop twice."""
    from kernels.paged_decode import paged_decode_attention_triton
    case = make_paged_case([0, 300, 65, 1], 8, 2, 64, 16, seed=splits)
    ref = reference_fp64(case)
    ws = kernels.DecodeWorkspace(max_seqs=4, num_kv_heads=2, device="cpu")
    outs = []
    for workspace in (ws, None, ws):
        out = torch.full_like(case.q, float("nan"))
        paged_decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                      num_splits=splits, out=out, workspace=workspace)
        assert rel_error(out, ref) <= 1e-5
        assert ws.idle()
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(outs[0], outs[2])


def test_workspace_through_the_public_call_and_its_errors():
    """The public call passes the workspace on (heuristic splits, GQA 6/1); a workspace too small for the
    batch, or not a DecodeWorkspace, is a ValueError naming the problem, and no plan is kept for it."""
    case = make_paged_case([700, 3, 129], 6, 1, 32, 8, seed=3)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    ws = kernels.DecodeWorkspace(max_seqs=3, num_kv_heads=1, device="cpu")
    out = torch.full_like(case.q, float("nan"))
    kernels.paged_decode_attention(*args, backend="triton", out=out, workspace=ws)
    assert rel_error(out, reference_fp64(case)) <= 1e-5 and ws.idle()
    small = kernels.DecodeWorkspace(2, 1, "cpu")
    for splits in (3, None):  # a new plan, and the plan of the call above
        with pytest.raises(ValueError, match="workspace holds 2 .* needs 3"):
            kernels.paged_decode_attention(*args, backend="triton", num_splits=splits, workspace=small)
    with pytest.raises(ValueError, match="DecodeWorkspace"):
        kernels.paged_decode_attention(*args, backend="triton", num_splits=4, workspace=torch.zeros(3))
    with pytest.raises(ValueError, match=">= 1"):
        kernels.DecodeWorkspace(0, 8, "cpu")
    # the torch backend has no splits to merge and ignores the workspace
    torch.testing.assert_close(kernels.paged_decode_attention(*args, backend="torch", workspace=ws),
                               out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bs,splits", [(16, 1), (16, 3), (4, 1)])
def test_offset_width_follows_the_rule_and_both_widths_match_reference(bs, splits):
    """One split over blocks of 8+ tokens computes cache offsets in int64 (the path caches of 2**31+ elements
    take too), tiny blocks and splits in int32; both are exact."""
    from kernels.paged_decode import paged_decode_attention_triton
    from kernels.split_heuristic import int32_offsets
    case = make_paged_case([1, 70, 300], 8, 2, 32, bs, dtype=torch.float32, seed=bs + splits)
    out = torch.full_like(case.q, float("nan"))
    cfg = KernelConfig(32, 4, 1)
    paged_decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                  num_splits=splits, out=out, config=cfg)
    assert rel_error(out, reference_fp64(case)) <= TOLERANCE[torch.float32]
    assert _last_plan().kw1["OFFSETS_32"] == int32_offsets(bs, splits)


def _last_plan():
    from kernels import paged_decode
    return list(paged_decode._PLANS.values())[-1]


def test_int32_offsets_only_where_every_cache_offset_fits():
    from kernels.paged_decode import _fits_int32
    meta = torch.empty(0, device="meta")
    fits = meta.new_empty((2**31 // 2048, 16, 1, 128))            # largest offset 2**31 - 1
    over = meta.new_empty((2**31 // 2048 + 1, 16, 1, 128))        # one block more
    assert _fits_int32(fits, fits) and not _fits_int32(fits, over)
    gaps = meta.new_empty((4, 16, 8, 128)).as_strided((4, 16, 8, 128), (2**30, 1024, 128, 1))
    assert not _fits_int32(gaps)                           # 3 * 2**30 + ...: strides count, not numel


def test_plans_are_per_signature_and_see_new_data():
    """A repeated call reuses its plan but reads the new inputs; another signature (here out's strides or
    the batch) gets its own plan, and bad inputs are refused before any plan is kept."""
    from kernels import paged_decode
    case = make_paged_case([40, 9], 4, 2, 32, 4, seed=3)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    before = len(paged_decode._PLANS)
    first = paged_decode.paged_decode_attention_triton(*args, num_splits=2)
    case.q.normal_()
    again = paged_decode.paged_decode_attention_triton(*args, num_splits=2)
    assert len(paged_decode._PLANS) == before + 1
    assert not torch.equal(first, again) and rel_error(again, reference_fp64(case)) <= 1e-5
    out_t = torch.full((32, 4, 2), float("nan")).permute(2, 1, 0)
    paged_decode.paged_decode_attention_triton(*args, num_splits=2, out=out_t)
    assert len(paged_decode._PLANS) == before + 2 and torch.equal(out_t, again)
    with pytest.raises(ValueError, match="one device|dtype"):
        paged_decode.paged_decode_attention_triton(case.q.double(), *args[1:])
    assert len(paged_decode._PLANS) == before + 2


@pytest.mark.parametrize("splits", [None, 1, 4, 7])
def test_split_size_from_the_table_or_from_seq_len(splits):
    """The heuristic's split count (None) and one split take the split size from the table width (the first
    block ids load alongside seq_len); a fixed count takes it from each sequence's length (batch invariance).
    Ragged lengths leave some splits empty, and entries past a sequence's end hold -1 and must not be read."""
    from kernels import paged_decode
    case = make_paged_case([0, 1, 130, 517, 64], 8, 2, 32, 4, seed=21)
    out = torch.full_like(case.q, float("nan"))
    paged_decode.paged_decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables,
                                               case.seq_lens, num_splits=splits, out=out)
    plan = _last_plan()
    assert plan.kw1["SPLITS_FROM_TABLE"] == (splits in (None, 1))
    assert plan.grid1[:2] == (2, 5)                                 # (Hkv, B, S): KV heads fastest
    assert rel_error(out, reference_fp64(case)) <= 1e-5
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("bs,splits", [(16, None), (4, 3), (1, 1)])
def test_head_major_cache_layout(bs, splits):
    """Caches stored head-major (N, Hkv, bs, D), passed as their (N, bs, Hkv, D) view: only strides differ."""
    case = make_paged_case([0, 77, 300, 5], 8, 2, 64, bs, seed=bs, layout="head")
    assert case.k_cache.stride()[1:3] == (64, bs * 64)
    out = _run(case, num_splits=splits)
    assert rel_error(out, reference_fp64(case)) <= 1e-5
