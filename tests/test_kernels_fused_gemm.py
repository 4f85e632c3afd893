"""kernels/fused_gemm.py (the gate_up GEMM with SiLU-and-mul, the qkv GEMM with RoPE + K/V store, both with
the folded norm) against the torch reference of the GEMM route's ops, on the Triton interpreter (fp32, fp16)
and in bf16 on the GPU; their checks."""

from __future__ import annotations

import os

import pytest
import torch

import kernels.fused_gemm as fused_mod
from kernels.fused_gemm import gated_gemm, gemm_add, gemm_rope_store
from kernels.fused_reference import gated_gemm_reference, gemm_add_reference, gemm_rope_store_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def poisoned(monkeypatch):
    """Every fresh output starts as NaN, so an element the kernel skips fails the comparison."""
    real = fused_mod._new_output
    monkeypatch.setattr(fused_mod, "_new_output", lambda m, n, x: real(m, n, x).fill_(float("nan")))


def make(m, n, k, dtype, device, bias, seed):
    """x (M, K) rows of different scales (so a wrong row's norm shows), weights (N, K) ~ 1/sqrt(K)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (0.5 + torch.rand(m, 1, generator=g) * 4.0)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), cast(w), cast(b)


CASES = [  # (M, I, K, norm, bias): one row, ragged rows, a full 64-row tile, two tiles; I and K off the tile
    (1, 64, 128, True, False),
    (5, 40, 96, True, True),
    (16, 96, 256, False, False),
    (64, 64, 200, True, False),
    (70, 33, 64, False, True),
]


def device_or_skip(device: str) -> None:
    if device == "cpu" and not INTERPRET:
        pytest.skip("needs the Triton interpreter")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def tolerance(dtype):
    return {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.float16),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
                                          pytest.param("cuda", torch.float16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,inter,k,norm,bias", CASES)
def test_gated_gemm_equals_the_gemm_route(poisoned, device, dtype, m, inter, k, norm, bias):
    device_or_skip(device)
    x, w, b = make(m, 2 * inter, k, dtype, device, bias, seed=m * inter + k)
    expect = gated_gemm_reference(x, w, b, norm=norm, eps=1e-5)
    got = gated_gemm(x, w, b, norm=norm, eps=1e-5)
    assert got.shape == (m, inter) and got.dtype == dtype
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got.float(), expect.float(), rtol=rtol, atol=atol)


@pytest.mark.skipif(not INTERPRET, reason="needs the Triton interpreter")
def test_gated_gemm_reads_strided_rows_and_no_rows():
    x, w, _ = make(6, 64, 64, torch.float32, "cpu", False, seed=1)
    wide = torch.cat([x, torch.randn(6, 16)], dim=1)[:, :64]  # rows 80 apart
    torch.testing.assert_close(gated_gemm(wide, w, norm=True, eps=1e-6),
                               gated_gemm_reference(x, w, norm=True, eps=1e-6), rtol=1e-5, atol=1e-5)
    assert gated_gemm(x[:0], w).shape == (0, 32)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x[0], w, {}), "x must be"),
    (lambda x, w: (x.t(), w[:, :3], {}), "contiguous rows"),
    (lambda x, w: (x.to(torch.int32), w, {}), "support"),
    (lambda x, w: (x, w[:, :8], {}), "weight must be"),
    (lambda x, w: (x, w[:5], {}), "weight must be"),
    (lambda x, w: (x, w.half(), {}), "weight must be"),
    (lambda x, w: (x, w, {"bias": torch.ones(3)}), "bias must be"),
])
def test_the_fused_gemms_refuse_what_they_do_not_take(bad, match):
    x, w = torch.randn(3, 16), torch.randn(6, 16)
    x, w, kw = bad(x, w)
    with pytest.raises(ValueError, match=match):
        gated_gemm(x, w, **kw)


ROPE_CASES = [  # (M, Hq, Hkv, D, K, norm, bias): GQA and MHA, D/2 not a power of two, padding rows, 2 tiles
    (3, 4, 2, 16, 64, True, False),
    (5, 2, 2, 16, 96, True, True),
    (4, 4, 1, 80, 128, False, True),
    (70, 4, 2, 32, 64, True, False),
]


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.float16),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,hq,hkv,d,k,norm,bias", ROPE_CASES)
def test_gemm_rope_store_equals_the_gemm_route(poisoned, device, dtype, m, hq, hkv, d, k, norm, bias):
    """The returned qkv (q, k rotated; v scaled) and the caches: each token's slot written, a slot -1 row
    stores nothing, every other slot keeps its poison."""
    device_or_skip(device)
    n = (hq + 2 * hkv) * d
    x, w, b = make(m, n, k, dtype, device, bias, seed=n + k + m)
    g = torch.Generator().manual_seed(d + m)
    angles = torch.rand(m, d // 2, generator=g) * 6.0
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    num_blocks, block_size = 2 * m + 2, 4
    caches = {name: torch.randn(num_blocks, block_size, hkv, d, generator=g).to(device=device, dtype=dtype)
              for name in ("k", "v")}
    slots = torch.randperm(num_blocks * block_size, generator=g)[:m]
    slots[1::3] = -1
    slots = slots.to(device=device, dtype=torch.int32)
    kw = dict(norm=norm, eps=1e-5, cos=cos, sin=sin, slot_mapping=slots, num_q_heads=hq, num_kv_heads=hkv)
    ref_caches = {name: c.clone() for name, c in caches.items()}
    expect = gemm_rope_store_reference(x, w, b, k_cache=ref_caches["k"], v_cache=ref_caches["v"], **kw)
    untouched = {name: c.clone() for name, c in caches.items()}
    got = gemm_rope_store(x, w, b, k_cache=caches["k"], v_cache=caches["v"], **kw)
    rtol, atol = tolerance(dtype)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expect.float(), rtol=rtol, atol=atol)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0].long().cpu()] = True
    for name in caches:
        torch.testing.assert_close(caches[name].float(), ref_caches[name].float(), rtol=rtol, atol=atol)
        flat, before = caches[name].flatten(0, 1).cpu(), untouched[name].flatten(0, 1).cpu()
        assert torch.equal(flat[~written], before[~written])


ADD_CASES = [(1, 64, 128, False), (5, 40, 96, True), (64, 48, 200, False), (70, 33, 64, True)]  # M N K bias


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.float16),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,n,k,bias", ADD_CASES)
def test_gemm_add_equals_addmm(device, dtype, m, n, k, bias):
    device_or_skip(device)
    x, w, b = make(m, n, k, dtype, device, bias, seed=m + n + k)
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(m)).to(device=device, dtype=dtype)
    expect = gemm_add_reference(x, w, residual.clone(), b)
    got = residual.clone()
    assert gemm_add(x, w, got, b) is got
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got.float(), expect.float(), rtol=rtol, atol=atol)


def test_gemm_add_refuses_a_residual_it_cannot_write():
    x, w = torch.randn(3, 16), torch.randn(16, 16)
    with pytest.raises(ValueError, match="residual must be"):
        gemm_add(x, w, torch.zeros(3, 8))
    with pytest.raises(ValueError, match="overlap"):
        gemm_add(x, w, x)
