"""The split-K residual GEMM (kernels/splitk_add.py) against its fp32 torch reference: random data, the
output poisoned where it must not be written, tile shapes that divide and that do not, every row count of
both tile configs, the ticket counters back at zero after each launch. CPU runs the interpreter in
fp32/fp16; `-m gpu` checks bf16 and fp32 at the bench shape's down projection and its bit-identical repeat."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import splitk_add as splitk_mod
from kernels.fused_reference import splitk_add_reference
from kernels.splitk_add import SPLITK_MAX_ROWS, splitk_add

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="the Triton kernel runs on CPU only under TRITON_INTERPRET=1")


def operands(m: int, n: int, k: int, dtype, device="cpu", seed: int = 0, row_pad: int = 0):
    """residual (m, n) as a view with `row_pad` poisoned columns after each row, x (m, k), weight (n, k)."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.full((m, n + row_pad), float("nan"), dtype=dtype)
    residual = storage[:, :n]
    residual.copy_(torch.randn(m, n, generator=gen) * 2)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    return storage.to(device), x.to(device), weight.to(device)


def check(m, n, k, dtype, row_pad=0, device="cpu", atol=None):
    storage, x, weight = operands(m, n, k, dtype, device, seed=m * 1000 + n + k, row_pad=row_pad)
    residual = storage[:, :n]
    want = splitk_add_reference(residual.clone(), x, weight).float()
    splitk_add(residual, x, weight)
    got = residual.float()
    tol = atol if atol is not None else (1e-4 if dtype == torch.float32 else 2e-2)
    assert torch.allclose(got, want, atol=tol, rtol=tol), float((got - want).abs().max())
    if row_pad:
        assert torch.isnan(storage[:, n:].float()).all(), "wrote past a row's end"
    assert not splitk_mod._tickets[torch.device(device)].any(), "a tile counter was left non-zero"


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 64])
def test_equals_reference_on_dividing_tiles(dtype, m):
    """N a multiple of the tile, K = SPLIT_K x whole BLOCK_K ranges (the unmasked weight loads)."""
    t = splitk_mod.tile_config(m)
    check(m, 2 * t.block_n, t.split_k * t.block_k, dtype, row_pad=3)


@interpreter_only
@pytest.mark.parametrize("m,n,k", [(3, 40, 200), (20, 70, 130), (64, 33, 1000), (2, 96, 100)])
def test_equals_reference_on_ragged_shapes(m, n, k):
    """N and K that divide no tile; K short enough that some splits hold no columns at all."""
    check(m, n, k, torch.float32, row_pad=2)


@interpreter_only
def test_one_split_adds_directly(monkeypatch):
    (most, tiles), *rest = splitk_mod.TILE_CLASSES
    monkeypatch.setattr(splitk_mod, "TILE_CLASSES", ((most, tiles._replace(split_k=1)), *rest))
    check(9, 64, 256, torch.float32)


@interpreter_only
def test_repeated_launches_reuse_the_counters():
    """Counters are zero after every launch, so back-to-back launches (one stream) merge correctly."""
    for _ in range(3):
        check(16, 64, 512, torch.float32, row_pad=0, atol=1e-4)
        check(40, 128, 640, torch.float32)


def test_refuses_what_it_does_not_serve():
    r = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="chain"):
        splitk_add(r, torch.zeros(4, 16), torch.zeros(8, 15))
    with pytest.raises(ValueError, match="one dtype"):
        splitk_add(r, torch.zeros(4, 16, dtype=torch.float16), torch.zeros(8, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="rows"):
        splitk_add(torch.zeros(SPLITK_MAX_ROWS + 1, 8), torch.zeros(SPLITK_MAX_ROWS + 1, 16),
                   torch.zeros(8, 16))
    with pytest.raises(ValueError, match="contiguous"):
        splitk_add(r, torch.zeros(16, 4).t(), torch.zeros(8, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 16, 24, 32, 33, 64])
def test_gpu_down_projection(m, dtype):
    """The bench shape's down projection (N 2048, K 8192) in bf16 and fp32 (its tiles need fewer pipeline
    stages to fit shared memory): within the dtype's rounding of the fp32 reference (fp32: IEEE dots), and
    the same bits on a repeat (the merge sums the splits in a fixed order)."""
    storage, x, weight = operands(m, 2048, 8192, dtype, "cuda", seed=m, row_pad=8)
    residual = storage[:, :2048]
    start = residual.clone()
    want = splitk_add_reference(residual.clone(), x, weight).float()
    splitk_add(residual, x, weight)
    got = residual.clone()
    err = float((got.float() - want).abs().max() / want.abs().max())
    assert err < 1e-2, err
    assert torch.isnan(storage[:, 2048:].float()).all()
    for _ in range(3):
        residual.copy_(start)
        splitk_add(residual, x, weight)
        assert torch.equal(residual, got)
    assert not splitk_mod._tickets[x.device].any()
