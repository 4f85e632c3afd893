"""kernels/gated_gemm.py (the gate_up GEMM with SiLU-and-mul and the folded norm as its epilogue) against the
torch reference of the GEMM route's ops, on the Triton interpreter (fp32, fp16) and in bf16 on the GPU; its
checks."""

from __future__ import annotations

import os

import pytest
import torch

import kernels.gated_gemm as gated_mod
from kernels.fused_reference import gated_gemm_reference
from kernels.gated_gemm import gated_gemm

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def poisoned(monkeypatch):
    """Every fresh output starts as NaN, so an element the kernel skips fails the comparison."""
    real = gated_mod._new_output
    monkeypatch.setattr(gated_mod, "_new_output", lambda m, n, x: real(m, n, x).fill_(float("nan")))


def make(m, inter, k, dtype, device, bias, seed):
    """x rows of different scales (so a wrong row's norm shows), weights ~ 1/sqrt(K)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (0.5 + torch.rand(m, 1, generator=g) * 4.0)
    w = torch.randn(2 * inter, k, generator=g) / k ** 0.5
    b = torch.randn(2 * inter, generator=g) if bias else None
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), cast(w), cast(b)


CASES = [  # (M, I, K, norm, bias): one row, ragged rows, a full 64-row tile, two tiles; I and K off the tile
    (1, 64, 128, True, False),
    (5, 40, 96, True, True),
    (16, 96, 256, False, False),
    (64, 64, 200, True, False),
    (70, 33, 64, False, True),
]


def tolerance(dtype):
    return {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.float16),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
                                          pytest.param("cuda", torch.float16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m,inter,k,norm,bias", CASES)
def test_gated_gemm_equals_the_gemm_route(poisoned, device, dtype, m, inter, k, norm, bias):
    if device == "cpu" and not INTERPRET:
        pytest.skip("needs the Triton interpreter")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x, w, b = make(m, inter, k, dtype, device, bias, seed=m * inter + k)
    expect = gated_gemm_reference(x, w, b, norm=norm, eps=1e-5)
    got = gated_gemm(x, w, b, norm=norm, eps=1e-5)
    assert got.shape == (m, inter) and got.dtype == dtype
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got.float(), expect.float(), rtol=rtol, atol=atol)


@pytest.mark.skipif(not INTERPRET, reason="needs the Triton interpreter")
def test_gated_gemm_reads_strided_rows_and_no_rows():
    x, w, _ = make(6, 32, 64, torch.float32, "cpu", False, seed=1)
    wide = torch.cat([x, torch.randn(6, 16)], dim=1)[:, :64]  # rows 80 apart
    torch.testing.assert_close(gated_gemm(wide, w, norm=True, eps=1e-6),
                               gated_gemm_reference(x, w, norm=True, eps=1e-6), rtol=1e-5, atol=1e-5)
    assert gated_gemm(x[:0], w).shape == (0, 32)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x[0], w, {}), "x must be"),
    (lambda x, w: (x.t(), w[:, :3], {}), "contiguous rows"),
    (lambda x, w: (x.to(torch.int32), w, {}), "supports"),
    (lambda x, w: (x, w[:, :8], {}), "weight must be"),
    (lambda x, w: (x, w[:5], {}), "weight must be"),
    (lambda x, w: (x, w.half(), {}), "weight must be"),
    (lambda x, w: (x, w, {"bias": torch.ones(3)}), "bias must be"),
])
def test_gated_gemm_refuses_what_it_does_not_take(bad, match):
    x, w = torch.randn(3, 16), torch.randn(6, 16)
    x, w, kw = bad(x, w)
    with pytest.raises(ValueError, match=match):
        gated_gemm(x, w, **kw)
