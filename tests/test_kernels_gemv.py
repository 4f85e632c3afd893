"""kernels/gemv.py (the one-row GEMV with its norm, gated and residual epilogues) against the torch
reference of the unfused ops, on the Triton interpreter (fp32, fp16) and in bf16 on the GPU; its checks."""

from __future__ import annotations

import os

import pytest
import torch

import kernels.gemv as gemv_mod
from kernels.fused_reference import gemv_reference
from kernels.gemv import gemv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def device_or_skip(device: str) -> None:
    if device == "cpu" and not INTERPRET:
        pytest.skip("needs the Triton interpreter")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture
def poisoned(monkeypatch):
    """Every fresh output starts as NaN, so a row the kernel skips fails the comparison."""
    real = gemv_mod._new_output
    monkeypatch.setattr(gemv_mod, "_new_output", lambda n, x: real(n, x).fill_(float("nan")))


def make(n_out, k, dtype, device, gated, bias, seed):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n_out if gated else n_out
    x = torch.randn(1, k, generator=g)
    w = torch.randn(rows, k, generator=g) / k ** 0.5
    b = torch.randn(rows, generator=g) if bias else None
    norm_w = 1.0 + 0.1 * torch.randn(k, generator=g)
    res = torch.randn(1, n_out, generator=g)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), cast(w), cast(b), cast(norm_w), cast(res)


CASES = [  # (N, K, norm, gated, residual, bias): pow2 and ragged K, N off the tile, one and many rows a tile
    (40, 64, False, False, False, False),
    (40, 64, True, False, False, True),
    (33, 96, True, True, False, False),
    (33, 96, False, True, False, True),
    (70, 256, False, False, True, False),
    (70, 256, False, False, True, True),
    (5, 8192, False, False, True, False),     # one row a program
    (24, 2048, True, True, False, False),
]


def tolerance(dtype):
    return {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}[dtype]


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.float16),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
                                          pytest.param("cuda", torch.float16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n,k,norm,gated,residual,bias", CASES)
def test_gemv_equals_the_unfused_ops(poisoned, device, dtype, n, k, norm, gated, residual, bias):
    device_or_skip(device)
    x, w, b, norm_w, res = make(n, k, dtype, device, gated, bias, seed=n * k)
    kw = dict(norm_weight=norm_w if norm else None, eps=1e-5, gated=gated)
    ref_res = res.clone() if residual else None
    expect = gemv_reference(x, w, b, residual=ref_res, **kw)
    got_res = res.clone() if residual else None
    got = gemv(x, w, b, residual=got_res, **kw)
    assert got.shape == (1, n) and got.dtype == dtype
    if residual:
        assert got is got_res  # in place
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got.float(), expect.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x.expand(2, -1), w, {}), "one contiguous row"),
    (lambda x, w: (x.to(torch.int32), w, {}), "supports"),
    (lambda x, w: (x, w[:, :8], {}), "weight must be"),
    (lambda x, w: (x, w.half(), {}), "weight must be"),
    (lambda x, w: (x, w[:5], {"gated": True}), "even"),
    (lambda x, w: (x, w, {"gated": True, "residual": torch.zeros(1, 3)}), "do not combine"),
    (lambda x, w: (x, w, {"residual": torch.zeros(1, 5)}), "residual must be"),
    (lambda x, w: (x, w, {"norm_weight": torch.ones(3)}), "norm_weight must be"),
    (lambda x, w: (x, w, {"bias": torch.ones(2)}), "bias must be"),
    (lambda x, w: (x, w[:, :16].repeat(3, 1)[:16], {"residual": x}), "overlap"),
])
def test_gemv_refuses_what_it_does_not_take(bad, match):
    x, w = torch.randn(1, 16), torch.randn(6, 16)
    x, w, kw = bad(x, w)
    with pytest.raises(ValueError, match=match):
        gemv(x, w, **kw)


ROPE_CASES = [  # (Hq, Hkv, D, K, bias, slot): GQA and MHA, a head dim whose half is not a power of two
    (4, 2, 16, 64, False, 5),
    (2, 2, 16, 96, True, 0),
    (4, 1, 80, 128, True, 13),
    (4, 2, 32, 64, False, -1),    # a padding row: nothing stored
]


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("cpu", torch.float16),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("hq,hkv,d,k,bias,slot", ROPE_CASES)
def test_gemv_rope_store_equals_gemv_then_rope_store(poisoned, device, dtype, hq, hkv, d, k, bias, slot):
    device_or_skip(device)
    from kernels.fused_reference import gemv_rope_store_reference
    from kernels.gemv import gemv_rope_store

    n = (hq + 2 * hkv) * d
    x, w, b, norm_w, _ = make(n, k, dtype, device, False, bias, seed=n + k)
    angles = torch.rand(1, d // 2, generator=torch.Generator().manual_seed(d)) * 6.0
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    caches = {name: torch.randn(4, 4, hkv, d).to(device=device, dtype=dtype) for name in ("k", "v")}
    slots = torch.tensor([slot], dtype=torch.int32, device=device)
    kw = dict(norm_weight=norm_w, eps=1e-5, cos=cos, sin=sin, slot_mapping=slots, num_q_heads=hq,
              num_kv_heads=hkv)
    ref_caches = {name: c.clone() for name, c in caches.items()}
    expect = gemv_rope_store_reference(x, w, b, k_cache=ref_caches["k"], v_cache=ref_caches["v"], **kw)
    got = gemv_rope_store(x, w, b, k_cache=caches["k"], v_cache=caches["v"], **kw)
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(got.float(), expect.float(), rtol=rtol, atol=atol)
    for name in caches:  # the token's slot written, every other slot as it was
        torch.testing.assert_close(caches[name].float(), ref_caches[name].float(), rtol=rtol, atol=atol)
    if slot < 0:
        assert all(torch.equal(caches[name], ref_caches[name]) for name in caches)


def test_pdl_is_off_where_it_cannot_run():
    """Programmatic dependent launch only for compiled code on CUDA (sm_90+): never on the CPU or the
    interpreter, where the kernels must not be asked for griddepcontrol."""
    from kernels.pdl import pdl_options, uses_pdl

    assert not uses_pdl(torch.device("cpu"))
    assert pdl_options(torch.device("cpu")) == {"USE_GDC": False}
    if INTERPRET and torch.cuda.is_available():
        assert pdl_options(torch.device("cuda", 0)) == {"USE_GDC": False}
