"""Helpers shared by the kernel tests, the GPU checks and the benchmark: random paged inputs and errors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference

TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@dataclass
class PagedCase:
    q: torch.Tensor             # (B, Hq, D)
    k_cache: torch.Tensor       # (N, block_size, Hkv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (B, max_blocks) int32, physical blocks shuffled
    seq_lens: torch.Tensor      # (B,) int32


def make_paged_case(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32,
                    device="cpu", seed=0, spare_blocks=3, strided=False, layout="token") -> PagedCase:
    """Random q/K/V with each sequence's blocks scattered over a shuffled physical pool (block 0 unused).

    Table entries past a sequence's length hold -1 so a kernel that dereferences them is caught.
    strided=True lays the caches out as every other head of a wider tensor (non-contiguous strides).
    layout="head" stores each block head-major (N, Hkv, bs, D) and returns the (N, bs, Hkv, D) view of it, so
    one head's tokens of a block are contiguous; "token" (default) is the plain (N, bs, Hkv, D) tensor.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    bsz = len(seq_lens)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(1, max(blocks_per_seq, default=1))
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    heads = 2 * num_kv_heads if strided else num_kv_heads

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    if layout not in ("token", "head"):
        raise ValueError(f"layout must be 'token' or 'head', got {layout!r}")
    if layout == "head":
        k_full = rand(num_blocks, heads, block_size, head_dim).transpose(1, 2)
        v_full = rand(num_blocks, heads, block_size, head_dim).transpose(1, 2)
    else:
        k_full = rand(num_blocks, block_size, heads, head_dim)
        v_full = rand(num_blocks, block_size, heads, head_dim)
    k_cache = k_full[:, :, ::2] if strided else k_full
    v_cache = v_full[:, :, 1::2] if strided else v_full
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.full((bsz, max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    q = rand(bsz, num_q_heads, head_dim)
    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    return PagedCase(q, k_cache, v_cache, tables.to(device), lens.to(device))


def reference_fp64(case: PagedCase, **kw) -> torch.Tensor:
    """The dense reference computed in fp64 (on the inputs' device)."""
    return reference.paged_decode_attention_dense(
        case.q.double(), case.k_cache.double(), case.v_cache.double(), case.block_tables, case.seq_lens, **kw)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error; NaN anywhere gives inf. A zero reference compares absolutely."""
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff
