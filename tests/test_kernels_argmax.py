"""The row argmax kernel (kernels/argmax.py) against torch.argmax: random rows, ties across chunks, +-inf,
NaN, signed zeros, all -inf rows, chunk counts from one to many. CPU runs the interpreter in fp32/fp16 (its
bf16 arithmetic is wrong); `-m gpu` checks bf16 and fp32 at V = 128256 over the decode batch sizes."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import argmax as argmax_mod
from kernels.argmax import argmax_rows

interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="the Triton kernel runs on CPU only under TRITON_INTERPRET=1")


def hostile_rows(V: int, dtype, gen: torch.Generator) -> torch.Tensor:
    """(8, V) rows: random; a max repeated in three far-apart columns; +inf twice among randoms; a NaN
    after a +inf and more NaNs later in its lane; all -inf; -0.0 before +0.0 as the max of negatives;
    coarse ties; one -inf-masked third."""
    rand = lambda: torch.randn(V, generator=gen) * 3  # noqa: E731
    rows = [rand() for _ in range(8)]
    top = float(rows[1].max()) + 1.0
    for col in (V // 2, 5, V - 1):
        rows[1][col] = top                       # first max at column 5
    rows[2][[V // 3, V - 2]] = float("inf")
    rows[3][[1, V // 2]] = torch.tensor([float("inf"), float("nan")])
    rows[3][[c for c in (V // 2 + 64, V // 2 + 2048) if c < V]] = float("nan")  # later NaNs, same lane
    rows[4].fill_(float("-inf"))
    rows[5] = -rows[5].abs() - 1.0
    rows[5][[V // 4, V // 2]] = torch.tensor([-0.0, 0.0])
    rows[6] = (rows[6] * 2).round() / 2
    rows[7][torch.randperm(V, generator=gen)[: V // 3]] = float("-inf")
    return torch.stack(rows).to(dtype)


def check(logits: torch.Tensor) -> None:
    got = argmax_rows(logits)
    want = torch.argmax(logits.float(), dim=-1)   # the widened values: the same order, ties and NaNs
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got.cpu(), want.cpu()), (got, want)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("V,block", [(300, 64), (4099, 2048), (1000, 1024)])
@pytest.mark.parametrize("target", [512, 1], ids=["tile_a_chunk", "row_a_chunk"])
def test_equals_torch_argmax_on_hostile_rows(monkeypatch, dtype, V, block, target):
    """8 rows: TARGET_PROGRAMS 512 gives each tile its own chunk (the merge decides), 1 one chunk a row (the
    lanes' running maxima decide)."""
    monkeypatch.setattr(argmax_mod, "BLOCK", block)
    monkeypatch.setattr(argmax_mod, "TARGET_PROGRAMS", target)
    check(hostile_rows(V, dtype, torch.Generator().manual_seed(V)))


@interpreter_only
@pytest.mark.parametrize("rows,target", [(1, 512), (3, 4), (37, 1), (5, 10_000)])
def test_chunk_counts_from_one_to_every_tile(monkeypatch, rows, target):
    """TARGET_PROGRAMS 1 leaves one chunk a row (the whole row in one program); large ones a tile a chunk."""
    monkeypatch.setattr(argmax_mod, "BLOCK", 32)
    monkeypatch.setattr(argmax_mod, "TARGET_PROGRAMS", target)
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, 333, generator=gen) * 2).round()   # ties in most rows
    check(logits)


@interpreter_only
def test_strided_rows_and_empty_batch():
    base = torch.randn(6, 520, generator=torch.Generator().manual_seed(1))
    check(base[::2, :500])                                           # row stride 1040, V 500
    assert argmax_rows(torch.empty(0, 7)).shape == (0,)


def test_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="in"):
        argmax_rows(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="unit stride"):
        argmax_rows(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="0 < V"):
        argmax_rows(torch.zeros(3, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_gpu_vocab_sized_rows(dtype, rows):
    """The first call of a shape goes through the JIT and binds its plan; the later ones launch the bound
    kernels with raw pointers: each of three calls reads its own tensor."""
    gen = torch.Generator().manual_seed(rows)
    V = 128256
    for _ in range(3):
        logits = torch.cat([hostile_rows(V, torch.float32, gen)] * (rows // 8 + 1))[:rows]
        check(logits[torch.randperm(rows, generator=gen)].to(dtype).cuda())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_warm_up_compiles_every_row_count_a_step_launches(monkeypatch):
    """After warm_up, no row count of 1..max_rows compiles anything: the plans' column partition is aligned
    whatever rows x chunks is (Triton specializes on pointer alignment), so each chunking's one warm-up
    launch is the variant every row count of it runs."""
    import triton

    compiles = []
    argmax_mod._PLANS.clear()
    argmax_mod.warm_up(256, 128256, torch.bfloat16, torch.device("cuda"))
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kw: compiles.append(kw["repr"]))
    logits = torch.randn(256, 128256, device="cuda").to(torch.bfloat16)
    for rows in range(1, 257):
        argmax_rows(logits[:rows])
    torch.cuda.synchronize()
    assert compiles == []


@interpreter_only
def test_a_plan_serves_its_shape_only(monkeypatch):
    """Calls of one signature share a plan; another shape, dtype or setting gets its own (a BLOCK patched
    by a test must not reuse a plan sized for the old one)."""
    monkeypatch.setattr(argmax_mod, "_PLANS", {})
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        check(torch.randn(3, 200, generator=gen))
    assert len(argmax_mod._PLANS) == 1
    check(torch.randn(4, 200, generator=gen))
    check(torch.randn(3, 200, generator=gen).half())
    monkeypatch.setattr(argmax_mod, "BLOCK", 32)
    check(torch.randn(3, 200, generator=gen))
    assert len(argmax_mod._PLANS) == 4


@interpreter_only
def test_warm_up_runs_each_chunking_once(monkeypatch):
    """4 tiles, 8 target programs: rows 1-2 take a tile a chunk; rows 3 ask for 3 chunks, get 2 of 2 tiles
    (whole tiles per chunk), as rows 4-7 do; rows 8-10 take one chunk -> three chunkings."""
    monkeypatch.setattr(argmax_mod, "BLOCK", 32)
    monkeypatch.setattr(argmax_mod, "TARGET_PROGRAMS", 8)
    launched = []
    monkeypatch.setattr(argmax_mod, "argmax_rows", lambda logits: launched.append(logits.shape[0]))
    assert argmax_mod.warm_up(10, 3 * 32 + 5, torch.float16, torch.device("cpu")) == 3
    assert launched == [1, 3, 8]


@interpreter_only
def test_kernel_sampler_takes_greedy_ids_from_the_kernel(monkeypatch):
    """Sampler(kernel=True) (what CUDA runs) draws an all-greedy step through argmax_rows, ties and NaNs as
    torch.argmax gives them; Sampler(kernel=False) keeps torch.argmax."""
    from server.engine.sampler import Sampler

    monkeypatch.setattr(argmax_mod, "BLOCK", 64)
    logits = hostile_rows(300, torch.float32, torch.Generator().manual_seed(3))
    rows = torch.arange(8)
    kernel = Sampler(8, 300, torch.device("cpu"), kernel=True)
    assert kernel.argmax is argmax_rows
    assert torch.equal(kernel(logits, rows, 0).token_ids, torch.argmax(logits, dim=-1))
    assert Sampler(8, 300, torch.device("cpu"), kernel=False).argmax is not argmax_rows
