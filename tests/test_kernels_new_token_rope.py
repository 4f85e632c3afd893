"""The decode launch that rotates and stores its new tokens itself (kernels/new_token_rope.py) against the two
launches it replaces (kernels/rope_store.py's RoPE + store, then the decode attention: the same bits
expected) and against an fp64 reference built from the projection, on the Triton interpreter in fp32/fp16;
in bf16 on the GPU. Outputs are poisoned with NaN, the new tokens' cache slots with large values."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import TOLERANCE, PagedCase, make_paged_case, reference_fp64, rel_error

import kernels
from kernels.new_token_rope import NewTokens
from kernels.rope_store import rope_store_kv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
F32, F16 = torch.float32, torch.float16
EPS = 1e-5
GRID = [  # seq_lens (0: a padding row), Hq, Hkv, D, block_size, num_splits, dtype, norm + bias, window
    ([5, 0, 37, 64], 4, 2, 32, 4, 1, F32, True, None),
    ([130, 3], 8, 8, 64, 16, 3, F16, False, None),
    ([17, 1, 300], 6, 1, 48, 1, 2, F32, True, None),
    ([9, 64, 33], 4, 1, 32, 8, 3, F16, True, 12),
    ([200, 2], 2, 2, 16, 16, 1, F32, False, 50),
]


class NewTokenCase:
    """A paged case whose sequences each decode one new token at position seq_len - 1: its qkv row as
    projected (un-normed, un-biased, un-rotated), the rows it is normed by, the bias, cos/sin, the slots
    (-1 for a seq_len of 0); the new tokens' slots in the caches hold a poison."""

    def __init__(self, lens, hq, hkv, d, bs, dtype, extras, seed, device="cpu"):
        self.paged = make_paged_case(lens, hq, hkv, d, bs, dtype=dtype, device=device, seed=seed)
        self.hq, self.hkv, self.d = hq, hkv, d
        gen = torch.Generator().manual_seed(seed + 1)
        rows, width, hidden = len(lens), (hq + 2 * hkv) * d, 3 * d + 8
        self.qkv = (torch.randn(rows, width, generator=gen) * 2).to(dtype=dtype, device=device)
        norm_of, bias = torch.randn(rows, hidden, generator=gen), torch.randn(width, generator=gen)
        self.norm_of = norm_of.to(dtype=dtype, device=device) if extras else None
        self.bias = bias.to(dtype=dtype, device=device) if extras else None
        pos = torch.tensor([max(n - 1, 0) for n in lens], dtype=torch.float32)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        angles = pos[:, None] * inv_freq[None, :]
        self.cos, self.sin = angles.cos().to(device), angles.sin().to(device)
        tables = self.paged.block_tables.cpu()
        slots = [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs if n else -1 for i, n in enumerate(lens)]
        self.slots = torch.tensor(slots, device=device)
        for cache in (self.paged.k_cache, self.paged.v_cache):
            live = self.slots[self.slots >= 0]
            cache[live // bs, live % bs] = 1e4

    def new_tokens(self, qkv: torch.Tensor) -> NewTokens:
        return NewTokens(qkv, self.cos, self.sin, self.slots, self.norm_of, EPS, self.bias)

    def q_of(self, qkv: torch.Tensor) -> torch.Tensor:
        return qkv.view(qkv.shape[0], self.hq + 2 * self.hkv, self.d)[:, :self.hq]

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.paged.k_cache.clone(), self.paged.v_cache.clone()


def _one_launch(case: NewTokenCase, backend="triton", **kw):
    """-> (out, k_cache, v_cache, qkv afterwards) of the decode call with new_tokens."""
    k_cache, v_cache = case.caches()
    qkv = case.qkv.clone()
    out = torch.full((qkv.shape[0], case.hq, case.d), float("nan"), dtype=qkv.dtype, device=qkv.device)
    res = kernels.paged_decode_attention(case.q_of(qkv), k_cache, v_cache, case.paged.block_tables,
                                         case.paged.seq_lens, backend=backend, out=out,
                                         new_tokens=case.new_tokens(qkv), **kw)
    assert res is out
    return out, k_cache, v_cache, qkv


def _two_launches(case: NewTokenCase, **kw):
    """-> (out, k_cache, v_cache) of the RoPE + store kernel, then the decode call on the rotated q."""
    k_cache, v_cache = case.caches()
    qkv = case.qkv.clone()
    rope_store_kv(qkv, case.cos, case.sin, k_cache, v_cache, case.slots, case.hq, case.hkv,
                  norm_of=case.norm_of, eps=EPS, bias=case.bias)
    out = torch.full((qkv.shape[0], case.hq, case.d), float("nan"), dtype=qkv.dtype, device=qkv.device)
    kernels.paged_decode_attention(case.q_of(qkv), k_cache, v_cache, case.paged.block_tables,
                                   case.paged.seq_lens, backend="triton", out=out, **kw)
    return out, k_cache, v_cache


def _reference_fp64(case: NewTokenCase, window) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the projection in fp64: the row scale, bias, RoPE; the new K/V written into fp64 caches; the
    dense attention -> (out, k_cache, v_cache) in fp64."""
    hq, hkv, d = case.hq, case.hkv, case.d
    x = case.qkv.double()
    if case.norm_of is not None:
        r = case.norm_of.double()
        x = x * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) + case.bias.double()
    heads = x.view(x.shape[0], hq + 2 * hkv, d)
    c, s = case.cos.double()[:, None, :], case.sin.double()[:, None, :]
    x1, x2 = heads[..., :d // 2], heads[..., d // 2:]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    q, k, v = rotated[:, :hq], rotated[:, hq:hq + hkv], heads[:, hq + hkv:]
    k_cache, v_cache = (t.double() for t in case.caches())
    bs = k_cache.shape[1]
    keep = case.slots >= 0
    slots = case.slots[keep]
    k_cache[slots // bs, slots % bs] = k[keep]
    v_cache[slots // bs, slots % bs] = v[keep]
    paged = PagedCase(q, k_cache, v_cache, case.paged.block_tables, case.paged.seq_lens)
    return reference_fp64(paged, sliding_window=window), k_cache, v_cache


@pytest.mark.skipif(not INTERPRET, reason="needs the Triton interpreter")
@pytest.mark.parametrize("lens,hq,hkv,d,bs,splits,dtype,extras,window", GRID)
@pytest.mark.parametrize("workspace", [False, True])
def test_one_launch_equals_rope_store_then_decode(lens, hq, hkv, d, bs, splits, dtype, extras, window,
                                                  workspace):
    case = NewTokenCase(lens, hq, hkv, d, bs, dtype, extras, seed=len(lens) * d + bs)
    ws = kernels.DecodeWorkspace(len(lens), hkv, "cpu") if workspace else None
    kw = dict(num_splits=splits, sliding_window=window, workspace=ws)
    out, k_cache, v_cache, qkv = _one_launch(case, **kw)
    want, k_want, v_want = _two_launches(case, **kw)
    assert torch.equal(out, want)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    assert torch.equal(qkv, case.qkv)  # the projection is left as it is
    ref, k_ref, v_ref = _reference_fp64(case, window)
    assert rel_error(out, ref) <= TOLERANCE[dtype]
    live = case.slots[case.slots >= 0]
    for got, exp in ((k_cache, k_ref), (v_cache, v_ref)):
        new_rows = (got[live // bs, live % bs], exp[live // bs, live % bs])
        assert rel_error(*new_rows) <= TOLERANCE[dtype]
    assert torch.equal(out[torch.tensor(lens) == 0], torch.zeros_like(out[torch.tensor(lens) == 0]))


@pytest.mark.skipif(not INTERPRET, reason="needs the Triton interpreter")
def test_a_live_slot_of_a_row_that_reads_nothing_is_stored_too():
    """As rope_store_kv stores every slot >= 0, a row of seq_len 0 with a live slot stores its new token
    (split 0 does: no split reads a position), and its output is zeros."""
    case = NewTokenCase([9, 0, 5], 4, 2, 32, 4, F32, True, seed=7)
    used = set(case.paged.block_tables[case.paged.block_tables >= 0].tolist())
    spare = min(set(range(1, case.paged.k_cache.shape[0])) - used)  # make_paged_case leaves 3 unused
    case.slots[1] = spare * 4 + 1
    for splits in (1, 3):
        out, k_cache, v_cache, _ = _one_launch(case, num_splits=splits)
        want, k_want, v_want = _two_launches(case, num_splits=splits)
        assert torch.equal(out, want) and torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
        assert not torch.equal(k_cache[spare, 1], case.paged.k_cache[spare, 1])


@pytest.mark.skipif(not INTERPRET, reason="needs the Triton interpreter")
def test_torch_backend_takes_the_same_call():
    """backend="torch" rotates and stores through the references and leaves qkv as it is, as the kernel."""
    case = NewTokenCase([7, 20, 1], 4, 2, 32, 4, F32, True, seed=3)
    out, k_cache, v_cache, qkv = _one_launch(case, num_splits=2)
    ref_out, ref_k, ref_v, ref_qkv = _one_launch(case, backend="torch")
    assert kernels.last_backend() == "torch"
    assert rel_error(out, ref_out) <= 1e-5
    torch.testing.assert_close(k_cache, ref_k)
    torch.testing.assert_close(v_cache, ref_v)
    assert torch.equal(ref_qkv, case.qkv)


def test_new_tokens_that_do_not_fit_raise():
    case = NewTokenCase([3, 5], 4, 2, 32, 4, F32, True, seed=1)
    k_cache, v_cache = case.caches()
    other = case.qkv.clone()
    with pytest.raises(ValueError, match="q heads of new_tokens.qkv"):
        kernels.paged_decode_attention(case.q_of(other), k_cache, v_cache, case.paged.block_tables,
                                       case.paged.seq_lens, backend="torch",
                                       new_tokens=case.new_tokens(case.qkv))
    sin = torch.zeros(2, 32)[:, :16]
    bad = NewTokens(case.qkv, case.cos, sin, case.slots, case.norm_of, EPS, case.bias)
    with pytest.raises(ValueError, match="share strides"):
        kernels.paged_decode_attention(case.q_of(case.qkv), k_cache, v_cache, case.paged.block_tables,
                                       case.paged.seq_lens, backend="torch", new_tokens=bad)
    bad = NewTokens(case.qkv, case.cos, case.sin, case.slots, case.norm_of, EPS, case.bias[:-1])
    with pytest.raises(ValueError, match="bias"):
        kernels.paged_decode_attention(case.q_of(case.qkv), k_cache, v_cache, case.paged.block_tables,
                                       case.paged.seq_lens, backend="torch", new_tokens=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,splits", [(2, 1), (64, 1), (64, 3), (256, 1)])
def test_gpu_bench_shape_in_bf16(rows, splits):
    """The bench preset's heads (Hq 32, Hkv 8, D 64, block 16, norm + bias) in bf16: the one launch against
    the two, three times each (a store that raced the loads would move between runs), and fp64."""
    lens = [577 + 37 * (i % 5) for i in range(rows)]
    case = NewTokenCase(lens, 32, 8, 64, 16, torch.bfloat16, True, seed=rows + splits, device="cuda")
    ws = kernels.DecodeWorkspace(rows, 8, "cuda")
    runs = [_one_launch(case, num_splits=splits, workspace=ws) for _ in range(3)]
    want, k_want, v_want = _two_launches(case, num_splits=splits, workspace=ws)
    for out, k_cache, v_cache, qkv in runs:
        assert torch.equal(out, runs[0][0])
        assert rel_error(out, want) <= 1e-2
        assert rel_error(k_cache, k_want) <= 1e-2 and rel_error(v_cache, v_want) <= 1e-2
        assert torch.equal(qkv, case.qkv)
    ref, _, _ = _reference_fp64(case, None)
    assert rel_error(runs[0][0], ref) <= TOLERANCE[torch.bfloat16]
