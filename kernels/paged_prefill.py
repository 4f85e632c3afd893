"""Triton paged prefill attention: varlen causal flash attention of many chunks over the block-table KV cache.

One launch, grid (query tile, KV head). Chunk i owns query rows [qsl[i], qsl[i+1]) of q and the tiles [qsl[i]
// BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): a key strictly increasing in i, so a program finds its chunk by
counting the keys <= its id, on the device, without a host sync; the grid is T // BLOCK_Q + num_chunks
programs, at most one idle per chunk. qsl[0] may be above 0: the runner passes its whole flat batch, decode
rows first; the rows before qsl[0] are not written (their programs return at once). A tile's BLOCK_M rows are
(query position, query head of the KV head's group) pairs, so every K/V tile load serves all heads of the
group (GQA without expanding K/V).

Each program walks its chunk's keys in tiles of BLOCK_N token positions looked up through the block table
(independent of block_size), with online softmax in fp32 and exp2. The key range is cut into three phases:
tiles partly before the sliding window of the tile's last query (masked), tiles every query of the tile sees
whole (no mask), and the diagonal tiles up to the tile's last query (masked); nothing past it is read.
Each phase loads a tile's block ids one tile ahead, so its K/V addresses come from registers and Triton's
software pipeline overlaps the K/V copies with the tile before (_attend_keys). The new tokens' K/V are
already in the cache (store_kv runs first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher
from kernels.prefill_dispatch import check_prefill_inputs

LOG2E = 1.4426950408889634
# the chunk-offset vector each program searches is padded to at least this many entries, so one compiled
# variant serves any step of up to MIN_CHUNKS_PAD - 1 chunks
MIN_CHUNKS_PAD = 512


@triton.jit
def _attend(q, k, v, m_i, l_i, acc, qk_scale, q_pos, key_pos, window,
            MASKED: tl.constexpr, WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K/V tile of online softmax: q (BM, DP); k, v (BN, DP); m_i (log2 units), l_i (BM,); acc (BM, DP).
    MASKED applies causality (key_pos <= q_pos) and, with WINDOW, the sliding window; a row may then see
    nothing in this tile (or yet), so its max stays -inf and is replaced by 0 where it is subtracted. An
    unmasked tile scales inside the exponent's FMA (qk * scale - max)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)                  # (BM, BN), unscaled
    if MASKED:
        qk = qk * qk_scale
        vis = key_pos[None, :] <= q_pos[:, None]
        if WINDOW:
            vis = vis & (key_pos[None, :] > q_pos[:, None] - window)
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
def _attend_keys(q, m_i, l_i, acc, qk_scale, q_pos, window, lo, end, hi, table_row, k_base, v_base, offs_n,
                 offs_d, d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, WINDOW: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Online softmax over the key tiles starting at lo, lo + BN, ... below end. Each tile's block ids are
    loaded one tile ahead, so its K/V addresses come from registers, not from a load in the same iteration:
    the software pipeline then overlaps the K/V copies with the tile before (H200, D 64: 8 x 1024 new over
    4096 cached 997 -> 860 us, over 0 cached 159 -> 142 us; docs/kernel.md)."""
    blk = _tile_blocks(table_row, lo + offs_n, hi, stride_tn, BLOCK_SIZE)
    for start in range(lo, end, BLOCK_N):
        key_pos = start + offs_n
        k, v = _kv_tiles(k_base, v_base, blk, key_pos, hi, offs_d, d_mask, stride_kb, stride_kt, stride_kd,
                         stride_vb, stride_vt, stride_vd, BLOCK_SIZE)
        blk = _tile_blocks(table_row, key_pos + BLOCK_N, hi, stride_tn, BLOCK_SIZE)
        m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, qk_scale, q_pos, key_pos, window, MASKED, WINDOW,
                                DOT_PRECISION)
    return m_i, l_i, acc


# window and num_chunks change from step to step: not specialised on (Triton would compile a variant for 1
# and for multiples of 16, each a stall of every stream when it first appears mid-serving)
@triton.jit(do_not_specialize=["window", "num_chunks"])
def _paged_prefill_kernel(
    Q, K, V, BLOCK_TABLES, QUERY_START_LOC, SEQ_LENS, OUT,
    qk_scale, window, num_chunks,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNKS_PAD: tl.constexpr,
    WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # tiles in reverse: the last tiles of a chunk, which see the most keys, start first and the tail is short
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)

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

    # ---- the Q tile: row r is query tile_q0 + r // GROUP_PAD, head kvh * GROUP + r % GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_q0 + rows // GROUP_PAD                               # (BM,) query index in the chunk
    head = kvh * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < n) & (rows % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_row = (q_lo + q_idx).to(tl.int64)
    q = tl.load(Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)  # (BM, DP)
    q_pos = ctx + q_idx                                             # (BM,) absolute positions

    # ---- key phases: [lo, mid) window edge (masked), [mid, diag) whole tiles, [diag, hi) diagonal (masked)
    first_pos = ctx + tile_q0
    last_pos = ctx + tl.minimum(tile_q0 + BLOCK_Q, n) - 1
    hi = last_pos + 1
    diag = first_pos // BLOCK_N * BLOCK_N
    lo = 0
    mid = 0
    if WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        # (operands clamped to >= 0 first: integer division of negatives differs between GPU and interpreter)
        whole = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N   # first tile all see
        mid = tl.minimum(tl.maximum(whole, lo), diag)

    table_row = BLOCK_TABLES + chunk.to(tl.int64) * stride_tb
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if WINDOW:
        m_i, l_i, acc = _attend_keys(
            q, m_i, l_i, acc, qk_scale, q_pos, window, lo, mid, hi, table_row, k_base, v_base, offs_n, offs_d,
            d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, BLOCK_N,
            BLOCK_SIZE, True, WINDOW, DOT_PRECISION)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, qk_scale, q_pos, window, mid, diag, hi, table_row, k_base, v_base, offs_n, offs_d,
        d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, BLOCK_N,
        BLOCK_SIZE, False, WINDOW, DOT_PRECISION)
    m_i, l_i, acc = _attend_keys(
        q, m_i, l_i, acc, qk_scale, q_pos, window, diag, hi, hi, table_row, k_base, v_base, offs_n, offs_d,
        d_mask, stride_tn, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, BLOCK_N,
        BLOCK_SIZE, True, WINDOW, DOT_PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                 # every valid row sees its own key
    tl.store(OUT + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


# direct launches after the first call of a specialisation (kernels/launch_cache.py): the JIT's per-call
# argument binding costs more host time than a small prefill kernel runs
_prefill = CachedLauncher(_paged_prefill_kernel, num_tensors=7)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int     # rows of a tile: query positions x padded group heads (BLOCK_Q = block_m // GROUP_PAD)
    block_n: int     # key positions per tile
    num_warps: int
    num_stages: int


# The configs shipped, by the widest head dim each serves (fp16/bf16; fp32 halves block_n):
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
# The interpreter (CPU) runs numpy per tile op: small tiles keep the tests' multi-tile paths short and fast
INTERPRETER_CONFIG = PrefillConfig(16, 16, 1, 1)


def default_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> PrefillConfig:
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    cfg = next(c for d, c in CONFIGS if head_dim <= d)
    if dtype == torch.float32:  # twice the bytes per K/V tile: half the tile keeps the stages in smem
        cfg = PrefillConfig(cfg.block_m, cfg.block_n // 2, cfg.num_warps, 2)
    return cfg


def _launch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, sliding_window,
            cfg: PrefillConfig):
    t, hq, d = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    num_chunks = seq_lens.shape[0]
    group = hq // hkv
    group_pad = triton.next_power_of_2(group)
    block_m = max(cfg.block_m, group_pad, 16)                       # tl.dot needs >= 16 rows
    block_q = block_m // group_pad
    grid = (t // block_q + num_chunks, hkv)
    _prefill(
        grid, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, 0 if sliding_window is None else int(sliding_window), num_chunks,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, HEAD_DIM=d,
        HEAD_DIM_PAD=triton.next_power_of_2(d), BLOCK_SIZE=block_size,
        CHUNKS_PAD=max(MIN_CHUNKS_PAD, triton.next_power_of_2(num_chunks + 1)),
        WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def paged_prefill_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale=None,
                                   sliding_window=None, out=None, config: PrefillConfig | None = None):
    """Checked public wrapper: out (T, Hq, D); kernels.prefill_dispatch.check_prefill_inputs says what it
    takes. `config` overrides the shipped tile config (benchmarks and tests)."""
    check_prefill_inputs("triton", q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
                         sliding_window)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    cfg = config or default_config(q.shape[2], q.dtype, q.device)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    return _launch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale, sliding_window,
                   cfg)
