"""The gate_up GEMM with the folded norm and SiLU-and-mul in its epilogue (kernels/gate_up_silu.py) against
its torch reference (the unfused ops in fp32, rounded where they round): random data at scales where the
norm's row scale matters, tiles that divide and that do not, every
row count of each tile class, and the model's formula computed independently once. CPU runs the
interpreter in fp32/fp16; `-m gpu` checks bf16 at the bench shape and its bit-identical repeat."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import gate_up_silu as gus_mod
from kernels.fused_reference import gate_up_silu_reference
from kernels.gate_up_silu import GATE_UP_SILU_MAX_ROWS, gate_up_silu

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.float16: {"atol": 2e-2, "rtol": 2e-2},
       torch.bfloat16: {"atol": 5e-2, "rtol": 5e-2}}


def operands(m: int, inter: int, k: int, dtype, device="cpu", seed: int = 0):
    """x (m, k) with rows of very different scales (so a missing or wrong row scale shows), weight (2I, k)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 1, m)[:, None]                      # (m, 1): row RMS from 0.1 to 10
    x = (torch.randn(m, k, generator=gen) * scales).to(dtype)
    weight = (torch.randn(2 * inter, k, generator=gen) * 3 * k ** -0.5).to(dtype)
    return x.to(device), weight.to(device)


def check(m, inter, k, dtype, device="cpu"):
    x, weight = operands(m, inter, k, dtype, device, seed=m * 1000 + inter + k)
    want = gate_up_silu_reference(x, weight, 1e-5)
    got = gate_up_silu(x, weight, 1e-5)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert torch.isfinite(got).all()


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 33, 64])
def test_equals_reference_on_dividing_tiles(dtype, m):
    """I a multiple of BLOCK_N, K of BLOCK_K (the unmasked weight loads); the rows that pad a tile."""
    t = gus_mod.tile_config(m)
    check(m, 2 * t.block_n, 2 * t.block_k, dtype)


@interpreter_only
@pytest.mark.parametrize("m,inter,k", [(3, 40, 200), (20, 70, 130), (64, 33, 100), (2, 96, 72)])
def test_equals_reference_on_ragged_shapes(m, inter, k):
    """I and K that divide no tile: masked weight rows and K columns."""
    check(m, inter, k, torch.float32)


@interpreter_only
def test_is_the_models_mlp_input():
    """Independently of the reference: the folded norm's weight in W, so the result is SiLU(norm(x) Wg'^T) *
    (norm(x) Wu'^T) with the plain RMSNorm and unfolded weights."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 48, generator=gen) * 4
    norm_weight = torch.rand(48, generator=gen) + 0.5
    gate_w, up_w = torch.randn(24, 48, generator=gen), torch.randn(24, 48, generator=gen)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    want = torch.nn.functional.silu(normed @ gate_w.T) * (normed @ up_w.T)
    folded = torch.cat((gate_w, up_w)) * norm_weight  # (2I, K): the norm's weight on each input column
    torch.testing.assert_close(gate_up_silu(x, folded, 1e-6), want, atol=1e-3, rtol=1e-3)


def test_refuses_what_it_does_not_serve():
    with pytest.raises(ValueError, match="weight must be"):
        gate_up_silu(torch.zeros(2, 8), torch.zeros(7, 8), 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        gate_up_silu(torch.zeros(2, 8), torch.zeros(6, 9), 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        gate_up_silu(torch.zeros(2, 8), torch.zeros(6, 8, dtype=torch.float16), 1e-5)
    with pytest.raises(ValueError, match="rows"):
        gate_up_silu(torch.zeros(GATE_UP_SILU_MAX_ROWS + 1, 8), torch.zeros(6, 8), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        gate_up_silu(torch.zeros(8, 2).t(), torch.zeros(6, 8), 1e-5)
    assert gate_up_silu(torch.zeros(0, 8), torch.zeros(6, 8), 1e-5).shape == (0, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 16, 24, 32, 33, 64])
def test_gpu_bench_shape(m, dtype):
    """The bench shape's gate_up (I 8192, K 2048) in bf16 and fp32 (fewer pipeline stages): within the
    dtype's rounding of the reference, and the same bits on a repeat."""
    x, weight = operands(m, 8192, 2048, dtype, "cuda", seed=m)
    want = gate_up_silu_reference(x, weight, 1e-5).float()
    got = gate_up_silu(x, weight, 1e-5)
    err = float((got.float() - want).abs().max() / want.abs().max())
    assert err < 2e-2, err
    for _ in range(3):
        assert torch.equal(gate_up_silu(x, weight, 1e-5), got)


def test_x_is_buffered_as_deep_as_the_weights_on_hopper():
    """The hazard of docs/kernel.md, checked without a GPU: compiled offline for sm_90 at the 64-row tile,
    x (which the wgmma reads asynchronously) gets as many shared-memory buffers as the weights. Summing its
    squares from a register copy gave it one fewer, and the loads ahead overwrote the tile in use."""
    from tools.ttgir_stages import TILES, buffers, ttgir

    try:
        text = ttgir(gus_mod._gate_up_silu_kernel, TILES | {"EVEN": True, "DOT_PRECISION": "tf32"})
    except Exception as e:  # a Triton without the NVIDIA backend or its ptxas cannot tell
        pytest.skip(f"no offline sm_90 compile here: {type(e).__name__}: {e}")
    stages = {shape.split("x")[0] for _, shape in buffers(text)}
    assert len(buffers(text)) == 3 and len(stages) == 1, buffers(text)
