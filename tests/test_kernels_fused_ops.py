"""The fused decoder-op kernels (add+RMSNorm, RoPE+KV store, SiLU-and-mul) vs their torch references, on the
Triton interpreter: fp32/fp16, odd sizes, 1 and 7 tokens, poisoned outputs, padding slots."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from kernels.activation import silu_and_mul
from kernels.fused_reference import (
    rms_norm_reference,
    rope_store_reference,
    silu_and_mul_reference,
)
from kernels.rmsnorm import rms_norm
from kernels.rope_store import rope_store_kv

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1")

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty returns NaN-filled floating tensors: an output element the kernel misses stays NaN."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = nan_empty
    try:
        yield
    finally:
        torch.empty = empty


def rows(t: int, width: int, dtype, gen, pad: int = 0) -> torch.Tensor:
    """(t, width) random rows; pad > 0 gives a row stride of width + pad (a view of a wider tensor)."""
    return torch.randn(t, width + pad, generator=gen).to(dtype)[:, :width]


# ---- add + RMSNorm --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hidden,pad", [(1, 80, 0), (7, 96, 16), (7, 256, 0), (3, 1500, 4)])
@pytest.mark.parametrize("add_residual", [False, True])
def test_rms_norm_matches_reference(dtype, tokens, hidden, pad, add_residual):
    gen = torch.Generator().manual_seed(hidden + tokens)
    x = rows(tokens, hidden, dtype, gen, pad)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = rows(tokens, hidden, dtype, gen) if add_residual else None
    res_ref = residual.clone() if add_residual else None
    with poisoned_empty():
        out = rms_norm(x, weight, 1e-5, residual=residual)
    ref = rms_norm_reference(x, weight, 1e-5, residual=res_ref)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if add_residual:
        torch.testing.assert_close(residual, res_ref, rtol=0, atol=0)  # the same one rounding of the sum


def test_rms_norm_normalises_to_unit_rms():
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)) * 7
    out = rms_norm(x, torch.ones(96), 1e-6)
    torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(5), rtol=1e-4, atol=1e-4)


def test_rms_norm_rejects_bad_inputs():
    x = torch.zeros(3, 16)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(16), 1e-5, residual=torch.zeros(3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm(torch.zeros(16, 3).t(), torch.ones(16), 1e-5)


# ---- SiLU-and-mul ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,inter,pad", [(1, 40, 0), (7, 48, 8), (2, 1500, 0)])
def test_silu_and_mul_matches_reference(dtype, tokens, inter, pad):
    gen = torch.Generator().manual_seed(inter)
    gate_up = rows(tokens, 2 * inter, dtype, gen, pad) * 3
    with poisoned_empty():
        out = silu_and_mul(gate_up)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_reference(gate_up), **TOL[dtype])
    gate, up = gate_up.float().chunk(2, dim=-1)  # the reference is the model's formula
    torch.testing.assert_close(out.float(), torch.nn.functional.silu(gate) * up, **TOL[dtype])


def test_silu_and_mul_rejects_an_odd_width():
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(torch.zeros(2, 7))


def folded_norm_row_scale(residual: torch.Tensor, eps: float) -> torch.Tensor:
    """(T, 1) fp32: the RMSNorm scale of each residual row, written out as the model's norm computes it."""
    r = residual.float()
    return 1.0 / torch.sqrt((r * r).sum(-1, keepdim=True) / r.shape[1] + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,inter,hidden,with_bias", [(1, 40, 24, False), (7, 48, 100, True),
                                                           (2, 1500, 64, True)])
@pytest.mark.parametrize("row_program_tokens", [1, 1024])
def test_silu_and_mul_applies_a_folded_norm_and_the_bias(dtype, tokens, inter, hidden, with_bias,
                                                         row_program_tokens, monkeypatch):
    """The folded pre-MLP norm: each row scaled by its residual row's RMSNorm scale, then the bias added; on
    a program per tile and on one per row (the interpreter's 32-wide tiles make the 1500 columns 47)."""
    import kernels.activation as activation

    monkeypatch.setattr(activation, "BLOCK", 32)
    monkeypatch.setattr(activation, "NORM_ROW_PROGRAM_TOKENS", row_program_tokens)
    gen = torch.Generator().manual_seed(inter + hidden)
    gate_up = rows(tokens, 2 * inter, dtype, gen, pad=8) * 20
    residual = rows(tokens, hidden, dtype, gen, pad=4) * 5
    bias = (torch.randn(2 * inter, generator=gen) * 0.5).to(dtype) if with_bias else None
    with poisoned_empty():
        out = silu_and_mul(gate_up, norm_of=residual, eps=1e-5, bias=bias)
    torch.testing.assert_close(out, silu_and_mul_reference(gate_up, residual, 1e-5, bias), **TOL[dtype])
    x = gate_up.float() * folded_norm_row_scale(residual, 1e-5) + (0.0 if bias is None else bias.float())
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), torch.nn.functional.silu(gate) * up, **TOL[dtype])
    assert not torch.allclose(out, silu_and_mul(gate_up), **TOL[dtype])  # the scale is applied


def test_the_folded_norm_inputs_are_checked():
    gate_up = torch.randn(3, 8)
    with pytest.raises(ValueError, match="norm_of"):
        silu_and_mul(gate_up, norm_of=torch.randn(2, 5))
    with pytest.raises(ValueError, match="norm_of"):
        silu_and_mul(gate_up, norm_of=torch.randn(3, 5).half())
    with pytest.raises(ValueError, match="bias"):
        silu_and_mul(gate_up, bias=torch.randn(4))
    qkv, cos, sin, k_cache, v_cache, slots = rope_case(3, 4, 2, 16, 4, torch.float32, False, 2)
    with pytest.raises(ValueError, match="norm_of"):
        rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, 4, 2, norm_of=torch.randn(3, 10)[:, ::2])
    with pytest.raises(ValueError, match="bias"):
        rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, 4, 2, bias=torch.randn(qkv.shape[1] - 1))


# ---- RoPE + K/V store -----------------------------------------------------------------------------------


def rope_case(tokens, hq, hkv, d, block_size, dtype, strided_cache, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 8
    qkv = rows(tokens, (hq + 2 * hkv) * d, dtype, gen, pad=d)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    width = 2 * d if strided_cache else d
    caches = [torch.full((num_blocks, block_size, hkv, width), float("nan")).to(dtype) for _ in range(2)]
    k_cache, v_cache = (c[..., :d] for c in caches)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(torch.int32)
    if tokens > 1:
        slots[tokens // 2] = -1
    return qkv, angles.cos(), angles.sin(), k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hq,hkv,d,block_size,strided", [
    (1, 4, 2, 16, 1, False),
    (7, 4, 2, 80, 16, True),
    (7, 3, 1, 96, 1, False),
    (7, 8, 8, 32, 16, False),
])
def test_rope_store_matches_reference(dtype, tokens, hq, hkv, d, block_size, strided):
    qkv, cos, sin, k_cache, v_cache, slots = rope_case(tokens, hq, hkv, d, block_size, dtype, strided, d)
    qkv_ref, k_ref, v_ref = qkv.clone(), k_cache.clone(), v_cache.clone()
    rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, hq, hkv)
    rope_store_reference(qkv_ref, cos, sin, k_ref, v_ref, slots, hq, hkv)
    torch.testing.assert_close(qkv, qkv_ref, **TOL[dtype])
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **TOL[dtype])
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, rtol=0, atol=0)
    written = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    written[slots[slots >= 0].long()] = True
    stored = ~k_cache.flatten(0, 1).isnan().any(-1).any(-1)  # (N * bs,) slots holding numbers
    assert torch.equal(stored, written)  # the -1 row and every other slot stay poisoned
    v = qkv.view(tokens, hq + 2 * hkv, d)[:, hq + hkv :]
    assert torch.equal(v_cache.flatten(0, 1)[slots[slots >= 0].long()], v[slots >= 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,hq,hkv,d,hidden,with_bias", [
    (1, 4, 2, 16, 24, True), (7, 4, 2, 80, 96, False), (7, 3, 1, 32, 40, True)])
def test_rope_store_applies_a_folded_norm_and_the_bias(dtype, tokens, hq, hkv, d, hidden, with_bias):
    """The folded pre-attention norm: every head, v included (rewritten in its row), scaled by the residual
    row's RMSNorm scale, then biased, before RoPE and the store."""
    qkv, cos, sin, k_cache, v_cache, slots = rope_case(tokens, hq, hkv, d, 16, dtype, True, d + hidden)
    gen = torch.Generator().manual_seed(hidden)
    qkv.mul_(20)
    residual = rows(tokens, hidden, dtype, gen, pad=4) * 5
    bias = (torch.randn(qkv.shape[1], generator=gen) * 0.5).to(dtype) if with_bias else None
    raw = qkv.clone()
    qkv_ref, k_ref, v_ref = qkv.clone(), k_cache.clone(), v_cache.clone()
    rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots, hq, hkv, norm_of=residual, eps=1e-6, bias=bias)
    rope_store_reference(qkv_ref, cos, sin, k_ref, v_ref, slots, hq, hkv, norm_of=residual, eps=1e-6,
                         bias=bias)
    torch.testing.assert_close(qkv, qkv_ref, **TOL[dtype])
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, **TOL[dtype])
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, **TOL[dtype])
    # v: the scaled, biased projection, in its row and in the cache slots; every other slot poisoned
    expect_v = raw.float() * folded_norm_row_scale(residual, 1e-6) + (0.0 if bias is None else bias.float())
    v = qkv.view(tokens, hq + 2 * hkv, d)[:, hq + hkv :]
    torch.testing.assert_close(v.float(), expect_v.view(tokens, hq + 2 * hkv, d)[:, hq + hkv :], **TOL[dtype])
    kept = slots >= 0
    assert torch.equal(v_cache.flatten(0, 1)[slots[kept].long()], v[kept])
    assert int((~v_cache.flatten(0, 1).isnan().any(-1).any(-1)).sum()) == int(kept.sum())


def test_rope_reference_is_the_models_rotation():
    """fp32: the reference rotation equals server.model.rope.apply_rope with cat(cos, cos) / cat(sin, sin)."""
    from server.model.rope import apply_rope

    qkv, cos, sin, k_cache, v_cache, slots = rope_case(5, 4, 2, 32, 16, torch.float32, False, 1)
    heads = qkv.clone().view(5, 8, 32)[:, :6]
    expect = apply_rope(heads, torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None])
    rope_store_reference(qkv, cos, sin, k_cache, v_cache, slots, 4, 2)
    torch.testing.assert_close(qkv.view(5, 8, 32)[:, :6], expect, rtol=1e-6, atol=1e-6)


def test_rope_store_rejects_bad_inputs():
    qkv, cos, sin, k_cache, v_cache, slots = rope_case(3, 4, 2, 16, 4, torch.float32, False, 2)
    with pytest.raises(ValueError, match="qkv"):
        rope_store_kv(qkv[:, :-1], cos, sin, k_cache, v_cache, slots, 4, 2)
    with pytest.raises(ValueError, match="cos"):
        rope_store_kv(qkv, cos.half(), sin, k_cache, v_cache, slots, 4, 2)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_store_kv(qkv, cos, sin, k_cache, v_cache, slots[:2], 4, 2)
    with pytest.raises(ValueError, match="dtype"):
        rope_store_kv(qkv, cos, sin, k_cache.half(), v_cache.half(), slots, 4, 2)
