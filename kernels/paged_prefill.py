"""Triton paged prefill attention: varlen causal flash attention of many chunks over the block-table KV cache.

One launch, grid (query tile, KV head) or (query tile, query head). Chunk i owns query rows [qsl[i], qsl[i+1])
of q and the tiles [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): a key strictly increasing in i, so a
program finds its chunk by counting the keys <= its id, on the device, without a host sync; the grid is
T // BLOCK_Q + num_chunks programs, at most one idle per chunk. qsl[0] may be above 0: the runner passes its
whole flat batch, decode rows first; the rows before qsl[0] are not written (their programs return at once).
With pack_group, a tile's BLOCK_M rows are (query position, query head of the KV head's group) pairs, so
every K/V tile load serves all heads of the group (GQA without expanding K/V); else they are positions of one
query head.

Each program walks its chunk's keys in tiles of BLOCK_N token positions with online softmax in fp32 and exp2,
each key range cut into phases: tiles partly before the sliding window of the tile's last query (masked),
tiles every query of the tile sees whole (no mask), and the tiles at the range's end (masked); nothing past
the tile's last query is read. The keys come from one or two places:
- through the block table (independent of block_size), block ids loaded one tile ahead so the K/V addresses
  come from registers and Triton's software pipeline overlaps the copies with the tile before
  (_attend_cached): the whole range [0, last query] when the caller passes no K/V rows, else the cached
  prefix [0, ctx) only;
- with the new tokens' K/V rows (k, v (T, Hkv, D), row r the key of q's row r, e.g. views of the qkv
  projection's output): the chunk's own keys [ctx, last query] through tensor descriptors, (BLOCK_N, D)
  tiles copied by the tensor memory engine (_attend_new).
The new tokens' K/V are in the cache either way (store_kv runs first).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.launch_cache import CachedLauncher
from kernels.prefill_dispatch import check_prefill_inputs

LOG2E = 1.4426950408889634
# the chunk-offset vector each program searches is padded to at least this many entries, so one compiled
# variant serves any step of up to MIN_CHUNKS_PAD - 1 chunks
MIN_CHUNKS_PAD = 512


@triton.jit
def _attend(q, k, v, m_i, l_i, acc, qk_scale, key_pos, key_lim, key_lo,
            MASKED: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K/V tile of online softmax: q (BM, DP); k, v (BN, DP); m_i (log2 units), l_i (BM,); acc (BM, DP).
    MASKED: row r sees the keys at positions key_lo[r] <= pos <= key_lim[r] (key_lo only with WINDOW); a
    row may then see nothing in this tile (or yet), so its max stays -inf and is replaced by 0 where it is
    subtracted. An unmasked tile (every row sees all of it) scales inside the exponent's FMA."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                  # (BM, BN), unscaled
    if MASKED:
        qk = qk * qk_scale
        vis = key_pos[None, :] <= key_lim[:, None]
        if WINDOW:
            vis = vis & (key_pos[None, :] >= key_lo[:, None])
        qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_sub[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)    # finite: every row sees the whole tile
        m_sub = m_new
        p = tl.exp2(qk * qk_scale - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tile_blocks(table_row, key_pos, hi, stride_tn, BLOCK_SIZE: tl.constexpr):
    """The physical block of each key position (BN,), int64; positions >= hi are not looked up (0)."""
    return tl.load(table_row + key_pos // BLOCK_SIZE * stride_tn, mask=key_pos < hi, other=0).to(tl.int64)


@triton.jit
def _kv_tiles(k_base, v_base, blk, key_pos, hi, offs_d, d_mask, stride_kb, stride_kt, stride_kd, stride_vb,
              stride_vt, stride_vd, BLOCK_SIZE: tl.constexpr):
    """The K and V tiles (BN, DP) of key positions key_pos (BN,) held in blocks blk; positions >= hi are not
    loaded."""
    tok = (key_pos % BLOCK_SIZE)[:, None]
    mask = (key_pos < hi)[:, None] & d_mask[None, :]
    k = tl.load(k_base + blk[:, None] * stride_kb + tok * stride_kt + offs_d[None, :] * stride_kd, mask=mask,
                other=0.0)
    v = tl.load(v_base + blk[:, None] * stride_vb + tok * stride_vt + offs_d[None, :] * stride_vd, mask=mask,
                other=0.0)
    return k, v


@triton.jit
def _cached_tile(q, m_i, l_i, acc, qk_scale, key_lim, key_lo, start, blk, hi, table_row, k_base, v_base,
                 offs_n, offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt,
                 stride_vd, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                 WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The tile at start, its blocks blk already loaded; -> the state and the next tile's blocks."""
    key_pos = start + offs_n
    k, v = _kv_tiles(k_base, v_base, blk, key_pos, hi, offs_d, d_mask, stride_kb, stride_kt, stride_kd,
                     stride_vb, stride_vt, stride_vd, BLOCK_SIZE)
    blk = _tile_blocks(table_row, key_pos + BLOCK_N, hi, stride_tn, BLOCK_SIZE)
    m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, qk_scale, key_pos, key_lim, key_lo, MASKED, WINDOW,
                            DOT_PRECISION)
    return m_i, l_i, acc, blk


@triton.jit
def _attend_cached(q, m_i, l_i, acc, qk_scale, key_lim, key_lo, lo, end, hi, table_row, k_base, v_base,
                   offs_n, offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt,
                   stride_vd, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                   WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """Online softmax over the key tiles at positions lo, lo + BN, ... below end, read through the block
    table (positions >= hi are not loaded). Each tile's block ids are loaded one tile ahead, so its K/V
    addresses come from registers, not from a load in the same iteration: the software pipeline then
    overlaps the K/V copies with the tile before (H200, D 64: 8 x 1024 new over 4096 cached 997 -> 860 us,
    over 0 cached 159 -> 142 us; docs/kernel.md). STAGES 0: the kernel's pipeline depth; n: the loop's own
    (an explicit depth equal to the kernel's ran slower than the implicit one on an H200, hence the 0)."""
    blk = _tile_blocks(table_row, lo + offs_n, hi, stride_tn, BLOCK_SIZE)
    if STAGES == 0:
        for start in range(lo, end, BLOCK_N):
            m_i, l_i, acc, blk = _cached_tile(
                q, m_i, l_i, acc, qk_scale, key_lim, key_lo, start, blk, hi, table_row, k_base, v_base,
                offs_n, offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt,
                stride_vd, BLOCK_N, BLOCK_SIZE, MASKED, WINDOW, DOT_PRECISION)
    else:
        for start in tl.range(lo, end, BLOCK_N, num_stages=STAGES):
            m_i, l_i, acc, blk = _cached_tile(
                q, m_i, l_i, acc, qk_scale, key_lim, key_lo, start, blk, hi, table_row, k_base, v_base,
                offs_n, offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt,
                stride_vd, BLOCK_N, BLOCK_SIZE, MASKED, WINDOW, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attend_new(q, m_i, l_i, acc, qk_scale, key_lim, key_lo, lo, end, ctx, row0, col, k_desc, v_desc, offs_n,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, GUARD: tl.constexpr, WINDOW: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """Online softmax over the chunk's own key tiles at positions lo, lo + BN, ... below end (>= ctx), read
    from the new tokens' K/V rows: position p is row row0 + p - ctx of k_desc / v_desc, (BN, D) tiles at
    column col. The tensor-memory copies need no addresses in registers (H200, 8 x 1024 new tokens: 273 ->
    193 us at D 128 against the block-table loads; docs/kernel.md). GUARD: the tiles reach past the chunk's
    last row into the next chunk's or padding rows, of any value: their weight is 0, which must not meet a
    NaN / inf there (0 x NaN = NaN in p @ v), so V's rows from `end` on are zeroed."""
    for start in range(lo, end, BLOCK_N):
        row = row0 + start - ctx
        k = k_desc.load([row, col])
        v = v_desc.load([row, col])
        if GUARD:
            v = tl.where((start + offs_n < end)[:, None], v, tl.zeros_like(v))  # (v's dtype kept)
        m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, qk_scale, start + offs_n, key_lim, key_lo, MASKED,
                                WINDOW, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _phases(a, b, first_vis, all_vis, diag, BLOCK_N: tl.constexpr):
    """Tile starts (lo, mid, whole_end) of the key range [a, b), tiles counted from a: [lo, mid) is the
    window edge (masked), [mid, whole_end) tiles every row sees whole, [whole_end, b) the masked rest.
    first_vis / all_vis: the first key position any / every row of the tile sees; diag: the first position
    some row does not see (causality or the range's end). (Operands are clamped to >= 0 before integer
    division: division of negatives differs between the GPU and the interpreter.)"""
    lo = a + (tl.minimum(tl.maximum(first_vis - a, 0), b - a) // BLOCK_N) * BLOCK_N
    whole_end = tl.maximum(a + (tl.maximum(diag - a, 0) // BLOCK_N) * BLOCK_N, lo)
    mid = tl.minimum(tl.maximum(a + tl.cdiv(tl.maximum(all_vis - a, 0), BLOCK_N) * BLOCK_N, lo), whole_end)
    return lo, mid, whole_end


# window and num_chunks change from step to step: not specialised on (Triton would compile a variant for 1
# and for multiples of 16, each a stall of every stream when it first appears mid-serving)
@triton.jit(do_not_specialize=["window", "num_chunks"])
def _paged_prefill_kernel(
    Q, K, V, BLOCK_TABLES, QUERY_START_LOC, SEQ_LENS, OUT, K_NEW, V_NEW,
    qk_scale, window, num_chunks,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNKS_PAD: tl.constexpr,
    WINDOW: tl.constexpr, NEW_KV: tl.constexpr, DOT_PRECISION: tl.constexpr, PREFIX_STAGES: tl.constexpr,
):
    # tiles in reverse: the last tiles of a chunk, which see the most keys, start first and the tail is short
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head0 = tl.program_id(1) * HEADS                   # the tile's first query head
    kvh = head0 // GROUP

    # ---- which chunk and which of its query tiles: count the chunks whose first tile is <= pid
    offs_c = tl.arange(0, CHUNKS_PAD)
    starts = tl.load(QUERY_START_LOC + offs_c, mask=offs_c < num_chunks, other=1 << 30)
    # (a program below chunk 0's first tile, over rows of q before qsl[0], takes chunk 0 at a negative tile)
    chunk = tl.maximum(tl.sum((starts // BLOCK_Q + offs_c <= pid).to(tl.int32), 0) - 1, 0)
    q_lo = tl.load(QUERY_START_LOC + chunk)
    n = tl.load(QUERY_START_LOC + chunk + 1) - q_lo
    tile_q0 = (pid - (q_lo // BLOCK_Q + chunk)) * BLOCK_Q             # first query of the tile, in the chunk
    if (tile_q0 < 0) | (tile_q0 >= n):
        return                                  # a row before qsl[0], a spare tile, or an empty chunk
    seq_len = tl.load(SEQ_LENS + chunk)
    ctx = seq_len - n                                               # tokens cached before this chunk

    # ---- the Q tile: row r is query tile_q0 + r // HEADS_PAD, head head0 + r % HEADS_PAD
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_q0 + rows // HEADS_PAD                               # (BM,) query index in the chunk
    head = head0 + rows % HEADS_PAD
    row_ok = (q_idx < n) & (rows % HEADS_PAD < HEADS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_row = (q_lo + q_idx).to(tl.int64)
    q = tl.load(Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)  # (BM, DP)
    q_pos = ctx + q_idx                                             # (BM,) absolute positions

    # ---- the keys the tile sees: [first_vis, last_pos]; every row sees [all_vis, first_pos]
    first_pos = ctx + tile_q0
    last_pos = ctx + tl.minimum(tile_q0 + BLOCK_Q, n) - 1
    hi = last_pos + 1
    first_vis = 0
    all_vis = 0
    key_lo = q_pos                                                  # (unused without a window)
    if WINDOW:
        first_vis = tl.maximum(first_pos - window + 1, 0)
        all_vis = tl.maximum(last_pos - window + 1, 0)
        key_lo = q_pos - window + 1

    table_row = BLOCK_TABLES + chunk.to(tl.int64) * stride_tb
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if NEW_KV:
        # the cached prefix [0, ctx) through the block table: every row sees all of it but the window
        lo, mid, whole_end = _phases(0, ctx, first_vis, all_vis, ctx, BLOCK_N)
        lim = tl.zeros_like(q_pos) + (ctx - 1)
        if WINDOW:
            m_i, l_i, acc = _attend_cached(
                q, m_i, l_i, acc, qk_scale, lim, key_lo, lo, mid, ctx, table_row, k_base, v_base, offs_n,
                offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                BLOCK_N, BLOCK_SIZE, True, WINDOW, DOT_PRECISION, PREFIX_STAGES)
        m_i, l_i, acc = _attend_cached(
            q, m_i, l_i, acc, qk_scale, lim, key_lo, mid, whole_end, ctx, table_row, k_base, v_base, offs_n,
            offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
            BLOCK_N, BLOCK_SIZE, False, WINDOW, DOT_PRECISION, PREFIX_STAGES)
        m_i, l_i, acc = _attend_cached(
            q, m_i, l_i, acc, qk_scale, lim, key_lo, whole_end, ctx, ctx, table_row, k_base, v_base, offs_n,
            offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
            BLOCK_N, BLOCK_SIZE, True, WINDOW, DOT_PRECISION, PREFIX_STAGES)
        # the chunk's own keys [ctx, hi) from its new K/V rows, causal
        lo, mid, diag = _phases(ctx, hi, first_vis, all_vis, first_pos, BLOCK_N)
        col = kvh * HEAD_DIM
        # the masked tiles from `cut` on reach past the chunk's last row (seq_len) and are guarded; the
        # others skip the guard, which costs where it runs (H200, D 64, tools/prefill_bench: guarding every
        # masked tile took 8 x 1024 new tokens 128 -> 186 us and 64 x 128 over 512 cached 171 -> 293 us;
        # guarding these only, 132 and 174 us)
        cut = diag + tl.cdiv(tl.maximum(seq_len - BLOCK_N + 1 - diag, 0), BLOCK_N) * BLOCK_N
        if WINDOW:
            m_i, l_i, acc = _attend_new(q, m_i, l_i, acc, qk_scale, q_pos, key_lo, lo, mid, ctx, q_lo, col,
                                        K_NEW, V_NEW, offs_n, BLOCK_N, True, False, WINDOW, DOT_PRECISION)
        m_i, l_i, acc = _attend_new(q, m_i, l_i, acc, qk_scale, q_pos, key_lo, mid, diag, ctx, q_lo, col,
                                    K_NEW, V_NEW, offs_n, BLOCK_N, False, False, WINDOW, DOT_PRECISION)
        m_i, l_i, acc = _attend_new(q, m_i, l_i, acc, qk_scale, q_pos, key_lo, diag, tl.minimum(cut, hi), ctx,
                                    q_lo, col, K_NEW, V_NEW, offs_n, BLOCK_N, True, False, WINDOW,
                                    DOT_PRECISION)
        m_i, l_i, acc = _attend_new(q, m_i, l_i, acc, qk_scale, q_pos, key_lo, cut, hi, ctx, q_lo, col,
                                    K_NEW, V_NEW, offs_n, BLOCK_N, True, True, WINDOW, DOT_PRECISION)
    else:
        # every key [0, hi) through the block table, causal
        lo, mid, diag = _phases(0, hi, first_vis, all_vis, first_pos, BLOCK_N)
        if WINDOW:
            m_i, l_i, acc = _attend_cached(
                q, m_i, l_i, acc, qk_scale, q_pos, key_lo, lo, mid, hi, table_row, k_base, v_base, offs_n,
                offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                BLOCK_N, BLOCK_SIZE, True, WINDOW, DOT_PRECISION, 0)
        m_i, l_i, acc = _attend_cached(
            q, m_i, l_i, acc, qk_scale, q_pos, key_lo, mid, diag, hi, table_row, k_base, v_base, offs_n,
            offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
            BLOCK_N, BLOCK_SIZE, False, WINDOW, DOT_PRECISION, 0)
        m_i, l_i, acc = _attend_cached(
            q, m_i, l_i, acc, qk_scale, q_pos, key_lo, diag, hi, hi, table_row, k_base, v_base, offs_n,
            offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
            BLOCK_N, BLOCK_SIZE, True, WINDOW, DOT_PRECISION, 0)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                 # every valid row sees its own key
    tl.store(OUT + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


# direct launches after the first call of a specialisation (kernels/launch_cache.py): the JIT's per-call
# argument binding costs more host time than a small prefill kernel runs
_prefill = CachedLauncher(_paged_prefill_kernel, num_tensors=9)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int     # rows of a tile: query positions x heads (BLOCK_Q = block_m // heads per tile)
    block_n: int     # key positions per tile
    num_warps: int
    num_stages: int
    pack_group: bool = True  # a tile's rows hold every head of the KV head's group (else one query head)
    # pipeline depth of the loops over the cached prefix when the new keys come from their K/V rows (None:
    # num_stages): in one kernel the prefix loops' registers and the new-key loop's add up, and a shallower
    # prefix pipeline leaves the new-key loop more (docs/kernel.md)
    prefix_stages: int | None = None


# The configs shipped, by the widest head dim each serves (fp16/bf16; fp32 halves block_n). Keys read
# through the block table only:
CONFIGS = (
    # D <= 64: 128-row tiles of 64 keys over 8 warps (two warpgroups of 64 rows): the fastest of the swept
    # configs on all four benchmark shapes (docs/kernel.md)
    (64, PrefillConfig(128, 64, 8, 3)),
    # D <= 128: 32-key tiles and four stages: the 128 x 128 fp32 accumulator stays in 4 warps' registers
    # with a deeper K/V pipeline (within 3% of the fastest swept config on every benchmark shape)
    (128, PrefillConfig(128, 32, 4, 4)),
    # D <= 256: a 64-row tile and two stages keep the accumulator in registers and K/V in shared memory
    (256, PrefillConfig(64, 32, 4, 2)),
)
# With the chunks' own K/V rows (tensor-memory copies for the new keys, the block table for the prefix), the
# prefix loops unpipelined: of the swept configs the ones whose slowest benchmark shape is fastest against
# SDPA (H200 sweep in docs/kernel.md; a pipelined prefix cost the no-prefix shape ~20% in registers)
NEW_KV_CONFIGS = (
    (64, PrefillConfig(128, 64, 8, 3, prefix_stages=2)),
    (128, PrefillConfig(64, 32, 4, 3, prefix_stages=1)),
    (256, PrefillConfig(64, 32, 4, 2, prefix_stages=1)),
)
# The interpreter (CPU) runs numpy per tile op: small tiles keep the tests' multi-tile paths short and fast
INTERPRETER_CONFIG = PrefillConfig(16, 16, 1, 1)


def default_config(head_dim: int, dtype: torch.dtype, device: torch.device, new_kv: bool = False
                   ) -> PrefillConfig:
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    cfg = next(c for d, c in (NEW_KV_CONFIGS if new_kv else CONFIGS) if head_dim <= d)
    if dtype == torch.float32:  # twice the bytes per K/V tile: half the tile keeps the stages in smem
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2, num_stages=2)
    return cfg


def takes_new_kv(k: torch.Tensor | None, v: torch.Tensor | None) -> bool:
    """Whether the new tokens' K/V rows (T, Hkv, D) can be read through tensor descriptors: a head dim that is
    a power of two, contiguous heads, 16-byte aligned rows, T > 0, and a Hopper or newer GPU (or the
    interpreter)."""
    if k is None or v is None:
        return False
    if k.is_cuda:
        if torch.cuda.get_device_capability(k.device)[0] < 9:
            return False
    elif not (k.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    d = k.shape[2]
    if d & (d - 1) or d < 16 or d > 256 or k.shape[0] == 0:
        return False
    return all(x.stride(2) == 1 and x.stride(1) == d and (x.stride(0) * x.element_size()) % 16 == 0
               and x.data_ptr() % 16 == 0 for x in (k, v))


def new_kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple:
    """Tensor descriptors of the rows k, v (T, Hkv, D) (takes_new_kv) as (T, Hkv * D) in (block_n, D)
    tiles."""
    d = k.shape[2]
    return tuple(TensorDescriptor(x, [x.shape[0], x.shape[1] * d], [x.stride(0), 1], [block_n, d])
                 for x in (k, v))


def _launch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, sliding_window,
            cfg: PrefillConfig, k_new, v_new):
    t, hq, d = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    num_chunks = seq_lens.shape[0]
    group = hq // hkv
    heads = group if cfg.pack_group else 1
    heads_pad = triton.next_power_of_2(heads)
    block_m = max(cfg.block_m, heads_pad, 16)                       # tl.dot needs >= 16 rows
    block_q = block_m // heads_pad
    grid = (t // block_q + num_chunks, hq // heads)
    _prefill(
        grid, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, k_new, v_new,
        scale * LOG2E, 0 if sliding_window is None else int(sliding_window), num_chunks,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, HEADS=heads, HEADS_PAD=heads_pad, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
        HEAD_DIM=d, HEAD_DIM_PAD=triton.next_power_of_2(d), BLOCK_SIZE=block_size,
        CHUNKS_PAD=max(MIN_CHUNKS_PAD, triton.next_power_of_2(num_chunks + 1)),
        WINDOW=sliding_window is not None, NEW_KV=k_new is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PREFIX_STAGES=cfg.prefix_stages or 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale=None,
                                   sliding_window=None, out=None, k=None, v=None,
                                   config: PrefillConfig | None = None):
    """Checked public wrapper: out (T, Hq, D); kernels.prefill_dispatch.check_prefill_inputs says what it
    takes. k, v (T, Hkv, D): the new tokens' K/V rows as stored in the cache (optional); where
    takes_new_kv says so, each chunk's own keys are read from them and only its cached prefix
    through the block table. `config` overrides the shipped tile config (benchmarks and tests)."""
    check_prefill_inputs("triton", q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
                         sliding_window, k, v)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    new_kv = takes_new_kv(k, v)
    cfg = config or default_config(q.shape[2], q.dtype, q.device, new_kv=new_kv)
    k_new, v_new = new_kv_descriptors(k, v, cfg.block_n) if new_kv else (None, None)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if not scale > 0:  # the unmasked tiles take the row max before scaling: a max only for scale > 0
        raise ValueError(f"scale must be > 0, got {scale}")
    return _launch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, sliding_window,
                   cfg, k_new, v_new)
