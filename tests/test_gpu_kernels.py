"""GPU checks of the Triton kernels (`pytest -m gpu`; skipped without CUDA): bf16, long sequences,
large batches, every head_dim and block size, batch invariance, store_kv. Poisoned outputs, fp64 reference."""

import pytest
import torch
from kernel_cases import TOLERANCE, make_paged_case, reference_fp64, rel_error

import kernels
from kernels import reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _run(case, **kw):
    out = torch.full_like(case.q, float("nan"))
    kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   out=out, **kw)
    assert kernels.last_backend() == "triton"
    return out


def _check(case, dtype, **kw):
    out = _run(case, **kw)
    kw.pop("num_splits", None)
    err = rel_error(out, reference_fp64(case, **kw))
    assert err <= TOLERANCE[dtype], f"relative error {err:.2e}"
    return out


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("hq,hkv,d,bs", [(32, 8, 128, 16), (8, 2, 64, 1), (6, 1, 80, 4), (4, 4, 96, 256),
                                         (16, 2, 256, 32), (1, 1, 32, 128), (64, 8, 128, 64)])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_grid(dtype, hq, hkv, d, bs, splits):
    lens = [0, 1, 17, 255, 1000, 4097]
    case = make_paged_case(lens, hq, hkv, d, bs, dtype=dtype, device="cuda", seed=d + bs, strided=bs == 4)
    out = _check(case, dtype, num_splits=splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("win", [1, 100, 5000])
def test_sliding_window(dtype, win):
    case = make_paged_case([3, 300, 9000], 32, 8, 128, 16, dtype=dtype, device="cuda", seed=win)
    _check(case, dtype, sliding_window=win)


@pytest.mark.parametrize("splits", [None, 1, 7, 64])
def test_long_sequence_32k(splits):
    case = make_paged_case([32768], 32, 8, 128, 16, dtype=BF16, device="cuda", seed=1)
    _check(case, BF16, num_splits=splits)


def test_large_batch():
    lens = torch.randint(1, 3000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    case = make_paged_case(lens, 32, 8, 128, 16, dtype=BF16, device="cuda", seed=2)
    _check(case, BF16)


@pytest.mark.parametrize("splits", [1, 8])
def test_caches_beyond_int32_offsets(splits):
    """Caches of more than 2**31 elements (4.3 GB each here) take int64 offsets: blocks at the top of the
    cache are read right. Only the blocks the table names hold data; the fp64 reference gathers them too."""
    from kernels.paged_decode import _fits_int32
    n_blocks, bs, hkv, d = 2**31 // (16 * 128) + 64, 16, 1, 128
    k_cache = torch.empty(n_blocks, bs, hkv, d, device="cuda", dtype=BF16)
    v_cache = torch.empty_like(k_cache)
    assert not _fits_int32(k_cache, v_cache)
    k_cache[0], v_cache[0] = 0, 0                       # the reference reads block 0 for padding (masked)
    gen = torch.Generator(device="cuda").manual_seed(5)
    table = torch.tensor([[n_blocks - 1 - 2 * i for i in range(40)], list(range(1, 41))], device="cuda",
                         dtype=torch.int32)
    for blocks in table:
        k_cache[blocks.long()] = torch.randn(40, bs, hkv, d, device="cuda", generator=gen).to(BF16)
        v_cache[blocks.long()] = torch.randn(40, bs, hkv, d, device="cuda", generator=gen).to(BF16)
    q = torch.randn(2, 8, d, device="cuda", generator=gen).to(BF16)
    seq_lens = torch.tensor([40 * bs - 3, 333], device="cuda", dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, num_splits=splits, out=out)
    ref = reference.paged_decode_attention_dense(q.double(), k_cache, v_cache, table, seq_lens)
    assert rel_error(out, ref) <= TOLERANCE[BF16]


@pytest.mark.parametrize("workspace", [False, True])
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_batch_invariance(splits, workspace):
    """Fixed num_splits: a sequence's output is bitwise identical whatever else is in the batch (with the
    stage-2 merge and with the in-launch merge of a DecodeWorkspace, which merges in split order)."""
    big = make_paged_case([5000, 123, 40000, 1, 777], 32, 8, 128, 16, dtype=BF16, device="cuda", seed=3)
    ws = kernels.DecodeWorkspace(5, 8, "cuda") if workspace else None
    together = _run(big, num_splits=splits, workspace=ws)
    for i in (0, 2, 4):
        for sl in (slice(i, i + 1), slice(0, i + 1)):
            big_part = make_paged_case([1], 32, 8, 128, 16, dtype=BF16, device="cuda")
            big_part.q, big_part.k_cache, big_part.v_cache = big.q[sl], big.k_cache, big.v_cache
            big_part.block_tables, big_part.seq_lens = big.block_tables[sl], big.seq_lens[sl]
            assert torch.equal(_run(big_part, num_splits=splits, workspace=ws)[-1], together[i])


def test_custom_scale_and_out_strides():
    case = make_paged_case([700, 50], 32, 8, 128, 16, dtype=BF16, device="cuda", seed=4)
    out = torch.full((128, 32, 2), float("nan"), device="cuda", dtype=BF16).permute(2, 1, 0)
    kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                   scale=0.2, out=out)
    assert rel_error(out, reference_fp64(case, scale=0.2)) <= TOLERANCE[BF16]


@pytest.mark.parametrize("dtype,bs,hkv,d", [(BF16, 16, 8, 128), (F16, 1, 2, 80), (F32, 256, 1, 64)])
def test_store_kv(dtype, bs, hkv, d):
    gen = torch.Generator(device="cuda").manual_seed(bs)
    k_cache = torch.randn(40, bs, hkv, d, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(40, bs, hkv, d, device="cuda", generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    key = torch.randn(33, hkv, d, device="cuda", generator=gen).to(dtype)
    value = torch.randn(33, hkv, d, device="cuda", generator=gen).to(dtype)
    slots = torch.randperm(40 * bs, device="cuda", generator=gen)[:33].to(torch.int32)
    slots[::5] = -1
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert kernels.last_backend() == "triton"
    reference.store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("splits", [1, 4])
def test_repeat_calls_through_the_launch_cache(splits):
    """Calls after the first launch the cached compiled kernel directly; they must see the new data."""
    case = make_paged_case([300, 4000], 32, 8, 128, 16, dtype=BF16, device="cuda", seed=9)
    for _ in range(3):
        case.q.normal_()
        case.k_cache.normal_()
        _check(case, BF16, num_splits=splits)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(2):
        k_cache = torch.zeros(8, 16, 8, 128, device="cuda", dtype=BF16)
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn(5, 8, 128, device="cuda", generator=gen).to(BF16)
        slots = torch.tensor([3, 17, -1, 100, 127], device="cuda")
        kernels.store_kv(key, key, k_cache, v_cache, slots)
        assert torch.equal(k_cache.view(-1, 8, 128)[slots[slots >= 0]], key[slots >= 0])


@pytest.mark.parametrize("splits", [2, 7, 64])
def test_workspace_merge_has_no_race(splits):
    """With a DecodeWorkspace the last split program merges partials other CTAs wrote in the same launch and
    resets its counter: a missing barrier/fence or a stale counter shows as a result that moves between
    identical runs or differs from the two-launch merge. 50 repeats each, one workspace throughout."""
    from kernels.paged_decode import paged_decode_attention_triton
    case = make_paged_case([8192, 300, 1, 4097] * 4, 32, 8, 128, 16, dtype=BF16, device="cuda", seed=splits)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    ws = kernels.DecodeWorkspace(16, 8, "cuda")
    two = paged_decode_attention_triton(*args, num_splits=splits)
    first = None
    for _ in range(50):
        out = torch.full_like(case.q, float("nan"))
        paged_decode_attention_triton(*args, num_splits=splits, out=out, workspace=ws)
        first = out.clone() if first is None else first
        assert torch.equal(out, first)
    assert ws.idle()
    assert rel_error(first, reference_fp64(case)) <= TOLERANCE[BF16]
    torch.testing.assert_close(first.float(), two.float(), rtol=1e-2, atol=1e-2)


VARIANTS = [(64, 4, 2), (64, 4, 3), (32, 4, 2), (128, 8, 3), (32, 2, 6)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("splits", [1, 5, 64])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_tile_configs(variant, splits, dtype):
    """Tile widths, warps and stages around the shipped configs against fp64, with ragged lengths so splits
    past a sequence's end are empty; stage-2 and in-launch merges, compiled and direct launches."""
    from kernels.paged_decode import paged_decode_attention_triton
    from kernels.split_heuristic import KernelConfig
    block_n, warps, stages = variant
    cfg = KernelConfig(min(block_n, 32) if dtype == F32 else block_n, warps, stages)
    case = make_paged_case([0, 1, 63, 300, 5000, 9001], 32, 8, 128, 16, dtype=dtype, device="cuda",
                           seed=splits)
    ws = kernels.DecodeWorkspace(6, 8, "cuda")
    for workspace in (None, None, ws, ws):   # first call compiles; the second launches directly
        out = torch.full_like(case.q, float("nan"))
        paged_decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                      num_splits=splits, out=out, config=cfg, workspace=workspace)
        assert rel_error(out, reference_fp64(case)) <= TOLERANCE[dtype]
        case.q.normal_()
    assert ws.idle()


@pytest.mark.parametrize("splits", [None, 1, 16])
def test_direct_launch_equals_the_public_launch_path(splits):
    """The fast launcher (kernels/launch_cache.py) gives bitwise the output of Triton's own launch path, and
    a decode under a captured CUDA graph gives the eager result."""
    from kernels import paged_decode
    case = make_paged_case([4000, 17, 32768], 32, 8, 128, 16, dtype=BF16, device="cuda", seed=7)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    ws = kernels.DecodeWorkspace(3, 8, "cuda")
    paged_decode.paged_decode_attention_triton(*args, num_splits=splits, workspace=ws)      # compiles, binds
    direct = paged_decode.paged_decode_attention_triton(*args, num_splits=splits, workspace=ws).clone()
    plan = list(paged_decode._PLANS.values())[-1]
    assert plan.bound is not None
    paged_decode._stage1.direct_ok = False
    try:
        paged_decode._PLANS.clear()
        public = paged_decode.paged_decode_attention_triton(*args, num_splits=splits, workspace=ws).clone()
    finally:
        paged_decode._stage1.direct_ok = True
        paged_decode._PLANS.clear()
    assert torch.equal(direct, public)
    out = torch.full_like(case.q, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        paged_decode.paged_decode_attention_triton(*args, num_splits=splits, out=out, workspace=ws)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode.paged_decode_attention_triton(*args, num_splits=splits, out=out, workspace=ws)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, direct) and ws.idle()


def test_workspace_decode_under_cuda_graph():
    """The in-launch merge inside a captured graph: replays give the eager result bitwise, again and again
    (each replay must leave the counters at zero for the next), also with the heuristic's split count."""
    case = make_paged_case([4000, 17, 32768], 32, 8, 128, 16, dtype=BF16, device="cuda", seed=9)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    ws = kernels.DecodeWorkspace(4, 8, "cuda")
    for splits in (16, None):
        out = torch.full_like(case.q, float("nan"))
        eager = kernels.paged_decode_attention(*args, num_splits=splits, workspace=ws).clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            kernels.paged_decode_attention(*args, num_splits=splits, workspace=ws, out=out)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernels.paged_decode_attention(*args, num_splits=splits, workspace=ws, out=out)
        for _ in range(5):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)
        assert ws.idle()
    assert rel_error(eager, reference_fp64(case)) <= TOLERANCE[BF16]


def test_launch_hooks_still_fire():
    """With a Triton launch hook installed (a profiler, say) launches go through Triton's own runner."""
    import triton

    from kernels.paged_decode import paged_decode_attention_triton
    seen = []

    def hook(meta):
        seen.append(meta)

    case = make_paged_case([3000], 32, 8, 128, 16, dtype=BF16, device="cuda", seed=8)
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    paged_decode_attention_triton(*args, num_splits=4)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        out = paged_decode_attention_triton(*args, num_splits=4)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 2                                # stage 1 and stage 2
    assert rel_error(out, reference_fp64(case)) <= TOLERANCE[BF16]


@pytest.mark.parametrize("num_tokens,num_decode_rows,num_pad", [(1, 1, 0), (300, 256, 37), (4096, 64, 100)])
def test_gpu_step_inputs_match_the_torch_derivation(num_tokens, num_decode_rows, num_pad):
    """The step-inputs kernel on CUDA (the direct launcher) equals BatchState's torch ops, device count
    included."""
    from kernels.step_inputs import step_inputs
    from server.engine.batch_state import BatchState

    state = BatchState(256, 8192, 16, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    state.block_tables[:256] = torch.randint(1, 200_000, (256, 8192), generator=gen, device="cuda",
                                             dtype=torch.int32)
    state.last_token[:] = torch.randint(3, 128_000, (257,), generator=gen, device="cuda")
    real = num_tokens - num_pad
    rows = torch.cat([torch.randint(0, 256, (real,), generator=gen, device="cuda"),
                      torch.full((num_pad,), 256, device="cuda")])
    pos = torch.cat([torch.randint(0, 8192 * 16, (real,), generator=gen, device="cuda"),
                     torch.full((num_pad,), -1, device="cuda")])
    ids = torch.randint(3, 128_000, (num_tokens,), generator=gen, device="cuda")
    ids[torch.rand(num_tokens, generator=gen, device="cuda") < 0.3] = -1  # pending: the last sampled token
    tokens = torch.stack([rows, pos, ids]).int().contiguous()
    count = torch.tensor([num_decode_rows // 2], dtype=torch.int32, device="cuda")
    for decode_count in (None, count):
        want = state._derive(tokens, num_decode_rows, decode_count)
        got = step_inputs(tokens, state.last_token, state.block_tables, 16, num_decode_rows, decode_count)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w)
