"""Triton qkv GEMM with the folded pre-attention RMSNorm, the bias, RoPE and the K/V store into the paged
cache in its epilogue, for decode-size M (up to QKV_ROPE_MAX_ROWS rows): the fused forward's attention
input, one launch where the GEMM route takes cuBLAS's GEMM and then kernels/rope_store.py's kernel.

qkv (M, (Hq + 2 Hkv) D) = s * (x W^T) + b, q and k heads rotated (rotate-half: element j of a head pairs
with j + D/2), k and v also written into the caches at each row's slot (slot < 0 stores nothing), where
W is the loader's qkv_proj weight with the norm's weight folded in (server/model/norm_folding.py) and
s = rsqrt(mean(x^2) + eps) per row of the un-normed residual stream x (M, K). Grid
(heads * D / (2 BLOCK_H), M / BLOCK_M): a program owns BLOCK_H rotation pairs of one head, i.e. two
accumulators for the columns j and j + D/2 it rotates together, so RoPE needs nothing from another program.
It walks all of K and sums its rows' squares on the way as the diagonal of a third product, x x^T, as
kernels/gate_up_silu.py does and for the same reason (x then feeds tensor-core dots alone and the pipeliner
buffers it as deep as the weights: the hazard in docs/kernel.md).

Rounding is the unfused path's: the product is rounded to the model dtype (the GEMM's output), then scaled,
biased and rotated in fp32 and rounded once (kernels/rope_store.py). The attention reads q, and a prefill
step's new k and v, from the returned qkv rows, which therefore hold the rotated q and k and the scaled v.

Why: at 64 rows the RoPE + store kernel and its launch gap cost about as much as the qkv GEMM's own weight
read (H100, bench preset: 43 µs a step against qkv's 117, docs/benchmarks/decode_forward_h100.md). Torch
reference: kernels.fused_reference.qkv_rope_store_reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher
from kernels.rope_store import check_rope_store
from kernels.splitk_add import device_tickets

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QKV_ROPE_MAX_ROWS = 64  # up to here the fused launch replaces cuBLAS's GEMM + the RoPE + store kernel


class Tiles(NamedTuple):
    """One launch's configuration: rows, rotation pairs (two weight rows each), K step."""

    block_m: int
    block_h: int
    block_k: int
    split_k: int     # K ranges a tile's programs split, merged by the last one (1: no merge)
    num_stages: int  # for 2-byte dtypes; fp32 takes half (its tiles are twice the shared memory)
    num_warps: int


# (the most rows, tiles), in increasing rows: the gate_up + SiLU kernel's row classes, 16 pairs (32 weight
# rows) a program so that the bench shape's 48 heads of 64 make 96 programs.
TILE_CLASSES = (
    (16, Tiles(16, 16, 128, 4, 4, 4)),
    (QKV_ROPE_MAX_ROWS, Tiles(64, 16, 128, 4, 4, 4)),
)


@triton.jit
def _epilogue(acc1, acc2, squares, rm, m_ok, pair, col, head, eps, K, block_size, BIAS, QKV, COS, SIN,
              K_CACHE, V_CACHE, SLOTS, stride_o, stride_cos, stride_sin,
              stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
              NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """The (BM, BH) products acc1 (columns col) and acc2 (col + HALF) of rows rm with their sums of squares
    (BM,) -> the qkv rows, scaled, biased and (q, k) rotated; k and v into the cache."""
    rstd = tl.rsqrt(squares / K + eps)[:, None]                      # (BM, 1)
    y1 = acc1.to(QKV.dtype.element_ty).to(tl.float32) * rstd         # rounded where the GEMM output is
    y2 = acc2.to(QKV.dtype.element_ty).to(tl.float32) * rstd
    if HAS_BIAS:
        y1 += tl.load(BIAS + col).to(tl.float32)[None, :]
        y2 += tl.load(BIAS + col + HALF).to(tl.float32)[None, :]
    if head < NUM_Q_HEADS + NUM_KV_HEADS:                            # q or k: rotated
        angle = rm[:, None].to(tl.int64)
        cos = tl.load(COS + angle * stride_cos + pair[None, :], mask=m_ok[:, None], other=0.0)
        sin = tl.load(SIN + angle * stride_sin + pair[None, :], mask=m_ok[:, None], other=0.0)
        y1, y2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
    out = QKV + rm[:, None].to(tl.int64) * stride_o + col[None, :]
    tl.store(out, y1.to(QKV.dtype.element_ty), mask=m_ok[:, None])
    tl.store(out + HALF, y2.to(QKV.dtype.element_ty), mask=m_ok[:, None])
    if head >= NUM_Q_HEADS:                                          # k or v: into the token's cache slot
        slot = tl.load(SLOTS + rm, mask=m_ok, other=-1).to(tl.int64)
        keep = (slot >= 0)[:, None]
        blk, off = slot // block_size, slot % block_size
        if head < NUM_Q_HEADS + NUM_KV_HEADS:
            dst = (K_CACHE + (blk * stride_kb + off * stride_kt + (head - NUM_Q_HEADS) * stride_kh)[:, None]
                   + pair[None, :] * stride_kd)
            tl.store(dst, y1.to(K_CACHE.dtype.element_ty), mask=keep)
            tl.store(dst + HALF * stride_kd, y2.to(K_CACHE.dtype.element_ty), mask=keep)
        else:
            kv_head = head - NUM_Q_HEADS - NUM_KV_HEADS
            dst = (V_CACHE + (blk * stride_vb + off * stride_vt + kv_head * stride_vh)[:, None]
                   + pair[None, :] * stride_vd)
            tl.store(dst, y1.to(V_CACHE.dtype.element_ty), mask=keep)
            tl.store(dst + HALF * stride_vd, y2.to(V_CACHE.dtype.element_ty), mask=keep)


@triton.jit
def _qkv_rope_store_kernel(
    X, W, BIAS, QKV, COS, SIN, K_CACHE, V_CACHE, SLOTS, PART, TICKETS, eps, M, K, block_size, k_per_split,
    stride_x, stride_o, stride_cos, stride_sin,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """QKV rows of tile pid_m, pairs of program pid_n: the products over K range [pid_k * k_per_split, +
    k_per_split) (a multiple of BLOCK_K); with SPLIT_K > 1 the program drawing its tile's last ticket sums
    the fp32 partials in PART in split order and finishes the tile (_epilogue). EVEN_K: K == SPLIT_K *
    k_per_split (unmasked loads; the weight rows always exist: HALF % BLOCK_H == 0)."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    head = pid_n // (HALF // BLOCK_H)                                # q heads, then k heads, then v heads
    pair = (pid_n % (HALF // BLOCK_H)) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BH,) j in [0, D/2)
    col = head * 2 * HALF + pair                                     # (BH,) first columns; partners + HALF
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                     # (BM,) rows
    rk = pid_k * k_per_split + tl.arange(0, BLOCK_K)                 # (BK,) this step's K columns
    m_ok = rm < M
    x_ptrs = X + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_ptrs = W + col[:, None].to(tl.int64) * K + rk[None, :]        # (BH, BK); the partners' HALF rows on
    partner = HALF * K
    acc1 = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    gram = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)            # x x^T: its diagonal, the rows' squares
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w1 = tl.load(w_ptrs)
            w2 = tl.load(w_ptrs + partner)
        else:
            k_ok = (rk + k < K)[None, :]                             # (a split's range ends in K)
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
            w1 = tl.load(w_ptrs, mask=k_ok, other=0.0)
            w2 = tl.load(w_ptrs + partner, mask=k_ok, other=0.0)
        acc1 = tl.dot(x, tl.trans(w1), acc1, input_precision=DOT_PRECISION)  # (BM, BH) fp32
        acc2 = tl.dot(x, tl.trans(w2), acc2, input_precision=DOT_PRECISION)
        gram = tl.dot(x, tl.trans(x), gram, input_precision=DOT_PRECISION)   # (BM, BM) fp32
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    rb = tl.arange(0, BLOCK_M)
    squares = tl.sum(tl.where(rb[:, None] == rb[None, :], gram, 0.0), axis=1)  # (BM,) sum of x^2 per row
    if SPLIT_K > 1:
        tiles = tl.num_programs(0) * tl.num_programs(2)
        tile = pid_m * tl.num_programs(0) + pid_n
        rt = tl.arange(0, BLOCK_M)[:, None] * (2 * BLOCK_H) + tl.arange(0, BLOCK_H)[None, :]  # (BM, BH)
        part = PART + tile * BLOCK_M * 2 * BLOCK_H + rt              # split 0's acc1; acc2 BLOCK_H on
        part_sq = PART + SPLIT_K * tiles * BLOCK_M * 2 * BLOCK_H + tile * BLOCK_M + rb  # split 0's squares
        split_acc = tiles * BLOCK_M * 2 * BLOCK_H                    # one split's stride, products
        tl.store(part + pid_k * split_acc, acc1)
        tl.store(part + pid_k * split_acc + BLOCK_H, acc2)
        tl.store(part_sq + pid_k * tiles * BLOCK_M, squares)
        # every thread's partial is stored (barrier) before the ticket's release; the acquire of the last
        # ticket orders the merge's loads after every other split's release (kernels/splitk_add.py)
        tl.debug_barrier()
        counter = TICKETS + tile
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            acc1 = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
            squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):                       # split order: deterministic
                acc1 += tl.load(part + s * split_acc, cache_modifier=".cg")
                acc2 += tl.load(part + s * split_acc + BLOCK_H, cache_modifier=".cg")
                squares += tl.load(part_sq + s * tiles * BLOCK_M, cache_modifier=".cg")
            _epilogue(acc1, acc2, squares, rm, m_ok, pair, col, head, eps, K, block_size, BIAS, QKV, COS, SIN,
                      K_CACHE, V_CACHE, SLOTS, stride_o, stride_cos, stride_sin, stride_kb, stride_kt,
                      stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
                      NUM_Q_HEADS, NUM_KV_HEADS, HALF, HAS_BIAS)
            tl.store(counter, 0)                                     # back to zero for the next launch
    else:
        _epilogue(acc1, acc2, squares, rm, m_ok, pair, col, head, eps, K, block_size, BIAS, QKV, COS, SIN,
                  K_CACHE, V_CACHE, SLOTS, stride_o, stride_cos, stride_sin, stride_kb, stride_kt,
                  stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
                  NUM_Q_HEADS, NUM_KV_HEADS, HALF, HAS_BIAS)


_kernel = CachedLauncher(_qkv_rope_store_kernel, num_tensors=11)


def tile_config(rows: int, head_dim: int) -> Tiles:
    """The launch configuration for `rows` (<= QKV_ROPE_MAX_ROWS) rows of heads of head_dim."""
    tiles = next(tiles for most, tiles in TILE_CLASSES if rows <= most)
    return tiles._replace(block_h=min(tiles.block_h, head_dim // 2))


def serves_head_dim(head_dim: int) -> bool:
    """Whether the kernel takes heads of head_dim: pairs in whole tiles of at least 16 (a tensor-core dot's
    narrowest side) and a power of two."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """x (M, K) un-normed rows, weight ((Hq + 2 Hkv) D, K) with the norm's weight folded in, bias (that,)
    or None -> qkv (M, (Hq + 2 Hkv) D): s * x W^T + bias with q and k rotated (cos, sin (M, D/2) fp32), the
    rotated k and the v also written into k_cache / v_cache (num_blocks, block_size, Hkv, D) at
    slot_mapping (M,) (< 0: skip). M <= QKV_ROPE_MAX_ROWS; rows of x contiguous, weight contiguous."""
    m, k = x.shape
    d = k_cache.shape[-1]
    n = (num_q_heads + 2 * num_kv_heads) * d
    if weight.shape != (n, k) or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"weight must be a contiguous ({n}, {k}) and x's rows contiguous, got "
                         f"{tuple(weight.shape)}, x strides {x.stride()}")
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise ValueError(f"qkv_rope_store takes one dtype of {DTYPES}, got {x.dtype}, {weight.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({n},), got {tuple(bias.shape)}")
    if m > QKV_ROPE_MAX_ROWS or not serves_head_dim(d):
        raise ValueError(f"qkv_rope_store serves up to {QKV_ROPE_MAX_ROWS} rows and head dims of 2^k >= 32, "
                         f"got {m} rows, head dim {d}")
    qkv = torch.empty(m, n, dtype=x.dtype, device=x.device)
    check_rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)
    if m:
        _launch(x, weight, bias, qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
                eps)
    return qkv


def _launch(x, weight, bias, qkv, cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, eps):
    m, k = x.shape
    half = k_cache.shape[-1] // 2
    t = tile_config(m, 2 * half)
    k_per_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k) * t.block_k
    grid = ((num_q_heads + 2 * num_kv_heads) * half // t.block_h, t.split_k, triton.cdiv(m, t.block_m))
    tickets = device_tickets(x.device)
    if grid[0] * grid[2] > tickets.numel():
        raise ValueError(f"qkv_rope_store holds {tickets.numel()} tile counters, {grid[0] * grid[2]} needed")
    part_floats = t.split_k * grid[0] * grid[2] * t.block_m * (2 * t.block_h + 1) if t.split_k > 1 else 1
    part = torch.empty(part_floats, dtype=torch.float32, device=x.device)
    _kernel(grid, x, weight, qkv if bias is None else bias, qkv, cos, sin, k_cache, v_cache, slots, part,
            tickets, float(eps), m, k, k_cache.shape[1], k_per_split, x.stride(0), qkv.stride(0),
            cos.stride(0), sin.stride(0), *k_cache.stride(), *v_cache.stride(),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HAS_BIAS=bias is not None,
            BLOCK_M=t.block_m, BLOCK_H=t.block_h, BLOCK_K=t.block_k, SPLIT_K=t.split_k,
            EVEN_K=k == t.split_k * k_per_split, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=t.num_warps,
            num_stages=t.num_stages if x.element_size() <= 2 else max(1, t.num_stages // 2))
