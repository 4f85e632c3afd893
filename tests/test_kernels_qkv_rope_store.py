"""The qkv GEMM with the folded norm, the bias, RoPE and the K/V store in its epilogue
(kernels/qkv_rope_store.py) against its torch reference (the unfused ops in fp32, rounded where they round)
and against the two launches it replaces: random rows at scales where the norm's row scale matters, poisoned
outputs and cache slots, a padding slot, strided caches, K that divides the tile and that does not, every
row count class, one and two programs a head. CPU runs the interpreter in fp32/fp16; `-m gpu` checks bf16
and fp32 at the bench shape and a bit-identical repeat."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import qkv_rope_store as qrs_mod
from kernels.fused_reference import qkv_rope_store_reference
from kernels.qkv_rope_store import QKV_ROPE_MAX_ROWS, qkv_rope_store, serves_head_dim
from kernels.rope_store import rope_store_kv

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-2, "rtol": 2e-2}}


def case(m, hq, hkv, d, k, dtype, *, bias=False, strided=False, device="cpu", seed=0):
    """Operands of one call: x (m, k) with row RMS from 0.1 to 10, the weight and bias, cos/sin of random
    positions, NaN-poisoned caches (strided: every head's D of a 2D-wide row) and slots with a -1 row."""
    gen = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]).to(dtype)
    weight = (torch.randn(n, k, generator=gen) * 2 * k ** -0.5).to(dtype)
    b = (torch.randn(n, generator=gen) * 0.5).to(dtype) if bias else None
    positions = torch.randint(0, 4000, (m,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = positions.float()[:, None] * inv_freq[None, :]        # (m, D/2)
    num_blocks, block_size = 2 + m // 4, 4
    width = 2 * d if strided else d
    caches = [torch.full((num_blocks, block_size, hkv, width), float("nan")).to(dtype) for _ in range(2)]
    k_cache, v_cache = (c[..., :d] for c in caches)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:m].to(torch.int32)
    if m > 1:
        slots[m // 2] = -1
    ops = dict(x=x, weight=weight, bias=b, cos=angles.cos(), sin=angles.sin(), k_cache=k_cache,
               v_cache=v_cache, slot_mapping=slots)
    return {name: (t.to(device) if t is not None else None) for name, t in ops.items()}


def run_both(ops, hq, hkv, eps=1e-5):
    """(qkv, k_cache, v_cache) of the kernel and of the reference, each on its own copy of the caches."""
    mine = dict(ops, k_cache=ops["k_cache"].clone(), v_cache=ops["v_cache"].clone())
    ref = dict(ops, k_cache=ops["k_cache"].clone(), v_cache=ops["v_cache"].clone())
    got = qkv_rope_store(**_args(mine), eps=eps, num_q_heads=hq, num_kv_heads=hkv)
    want = qkv_rope_store_reference(**_args(ref), eps=eps, num_q_heads=hq, num_kv_heads=hkv)
    return (got, mine["k_cache"], mine["v_cache"]), (want, ref["k_cache"], ref["v_cache"])


def _args(ops):
    return {name: ops[name] for name in ("x", "weight", "bias", "cos", "sin", "k_cache", "v_cache",
                                         "slot_mapping")}


def assert_same(got, want, slots, tol):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), equal_nan=True, **tol)
    k_cache = got[1]
    written = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    for cache in got[1:]:  # every slot but the rows' holds its NaN poison; the written ones hold numbers
        stored = ~cache.flatten(0, 1).isnan().any(-1).any(-1)
        assert torch.equal(stored.cpu(), written)
    assert torch.isfinite(got[0]).all()


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64])
def test_equals_reference_on_dividing_tiles(dtype, m):
    """K a multiple of the splits' BLOCK_K (unmasked loads); rows that pad a tile; D 64: two programs a
    head."""
    t = qrs_mod.tile_config(m, 64)
    ops = case(m, 4, 2, 64, 2 * t.split_k * t.block_k, dtype, seed=m)
    got, want = run_both(ops, 4, 2)
    assert_same(got, want, ops["slot_mapping"], TOL[dtype])


@interpreter_only
@pytest.mark.parametrize("m,hq,hkv,d,k,bias,strided", [
    (3, 2, 1, 32, 200, True, False),   # ragged K, one program a head, the bias
    (20, 3, 3, 64, 72, False, True),   # MHA, strided caches
    (9, 4, 1, 128, 96, True, True),    # MQA, four programs a head
])
def test_equals_reference_on_ragged_shapes(m, hq, hkv, d, k, bias, strided):
    ops = case(m, hq, hkv, d, k, torch.float32, bias=bias, strided=strided, seed=k)
    got, want = run_both(ops, hq, hkv)
    assert_same(got, want, ops["slot_mapping"], TOL[torch.float32])


@interpreter_only
@pytest.mark.parametrize("bias", [False, True])
def test_is_the_two_launches_it_replaces(bias):
    """Independently of the reference: F.linear of the un-normed rows, then kernels/rope_store.py's kernel
    with the folded norm and the bias (the fused forward's route above QKV_ROPE_MAX_ROWS rows)."""
    ops = case(12, 4, 2, 32, 96, torch.float32, bias=bias, seed=7)
    got, _ = run_both(ops, 4, 2, eps=1e-6)
    k_cache, v_cache = ops["k_cache"].clone(), ops["v_cache"].clone()
    qkv = F.linear(ops["x"], ops["weight"])
    rope_store_kv(qkv, ops["cos"], ops["sin"], k_cache, v_cache, ops["slot_mapping"], 4, 2,
                  norm_of=ops["x"], eps=1e-6, bias=ops["bias"])
    for g, w in zip(got, (qkv, k_cache, v_cache), strict=True):
        torch.testing.assert_close(g, w, equal_nan=True, atol=1e-4, rtol=1e-4)


@interpreter_only
@pytest.mark.parametrize("split_k,k", [(1, 64), (2, 256), (3, 200), (4, 40)])
def test_every_split_count_merges_to_the_reference(monkeypatch, split_k, k):
    """K split 1-4 ways (whole, even, ragged, and splits with nothing of K left), merged by the last program
    of each tile; twice, so the tile counters are back at zero after a launch."""
    tiles = qrs_mod.Tiles(16, 16, 32, split_k, 2, 4)
    monkeypatch.setattr(qrs_mod, "tile_config", lambda rows, head_dim: tiles)
    for seed in (1, 2):
        ops = case(11, 4, 2, 64, k, torch.float32, bias=True, seed=seed)
        got, want = run_both(ops, 4, 2)
        assert_same(got, want, ops["slot_mapping"], TOL[torch.float32])
    assert not qrs_mod.device_tickets(torch.device("cpu")).any()


def test_serves_head_dims_of_whole_pair_tiles():
    assert [d for d in (16, 32, 48, 64, 80, 96, 128, 256) if serves_head_dim(d)] == [32, 64, 128, 256]
    assert qrs_mod.tile_config(64, 32).block_h == 16 and qrs_mod.tile_config(2, 256).block_h == 16


def test_refuses_what_it_does_not_serve():
    ops = case(3, 4, 2, 32, 16, torch.float32)
    kw = dict(eps=1e-5, num_q_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="weight must be"):
        qkv_rope_store(**_args(dict(ops, weight=ops["weight"][1:])), **kw)
    with pytest.raises(ValueError, match="weight must be"):
        qkv_rope_store(**_args(dict(ops, x=ops["x"].t().contiguous().t())), **kw)
    with pytest.raises(ValueError, match="one dtype"):
        qkv_rope_store(**_args(dict(ops, weight=ops["weight"].half())), **kw)
    with pytest.raises(ValueError, match="bias"):
        qkv_rope_store(**_args(dict(ops, bias=torch.zeros(5))), **kw)
    with pytest.raises(ValueError, match="rows"):
        big = case(QKV_ROPE_MAX_ROWS + 1, 4, 2, 32, 16, torch.float32)
        qkv_rope_store(**_args(big), **kw)
    with pytest.raises(ValueError, match="head dim"):
        odd = case(3, 4, 2, 48, 16, torch.float32)
        qkv_rope_store(**_args(odd), **kw)
    with pytest.raises(ValueError, match="slot_mapping"):
        qkv_rope_store(**_args(dict(ops, slot_mapping=ops["slot_mapping"][:2])), **kw)
    empty = case(0, 4, 2, 32, 16, torch.float32)
    assert qkv_rope_store(**_args(empty), **kw).shape == (0, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [2, 7, 16, 24, 33, 64])
def test_gpu_bench_shape(m, dtype):
    """The bench shape's qkv (32 q and 8 kv heads of 64, K 2048) in bf16 and fp32 (fewer pipeline
    stages): within the dtype's rounding of the reference, caches written where the slots say, and the same
    bits on a repeat."""
    ops = case(m, 32, 8, 64, 2048, dtype, device="cuda", seed=m)
    got, want = run_both(ops, 32, 8)
    for g, w in zip(got, want, strict=True):
        ok = ~w.isnan()
        err = float((g[ok].float() - w[ok].float()).abs().max() / w[ok].float().abs().max())
        assert err < 2e-2, err
    assert torch.equal(got[1].isnan(), want[1].isnan()) and torch.equal(got[2].isnan(), want[2].isnan())
    for _ in range(3):
        again, _ = run_both(ops, 32, 8)
        assert all(torch.equal(a.nan_to_num(), g.nan_to_num()) for a, g in zip(again, got, strict=True))


def test_x_is_buffered_as_deep_as_the_weights_on_hopper():
    """The hazard of docs/kernel.md, checked without a GPU: compiled offline for sm_90 at the 64-row tile,
    x (which the wgmma reads asynchronously) gets as many shared-memory buffers as the two weight tiles."""
    from tools.ttgir_stages import QKV_TILES, buffers, ttgir

    try:
        text = ttgir(qrs_mod._qkv_rope_store_kernel, QKV_TILES)
    except Exception as e:  # a Triton without the NVIDIA backend or its ptxas cannot tell
        pytest.skip(f"no offline sm_90 compile here: {type(e).__name__}: {e}")
    stages = {shape.split("x")[0] for _, shape in buffers(text)}
    assert len(buffers(text)) == 3 and len(stages) == 1, buffers(text)
