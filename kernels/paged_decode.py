"""Triton paged-decode attention: block-table walk, online softmax, split-KV LSE merge, GQA-native.

Stage 1, grid (kv_head, seq, split) (the KV heads of one token range run side by side and read neighbouring
DRAM rows): the query heads of one KV head are the rows of one tile, so they share each K/V load; each
program walks its split's tokens in tiles of BLOCK_N looked up through the block table (the tile width is
independent of block_size), keeps m, l, o in fp32 and rescales by exp2(m_old - m_new). With one split it
writes the final output. With several it writes a normalised partial output and its log2-sum-exp, and the
splits are merged by their LSE (kernels/split_merge.py): when the caller passes a `DecodeWorkspace`, in the
same launch -- every split program takes a ticket from its (seq, kv_head) counter after its partial is
written, the one that draws the last ticket merges all splits in split order (so the result does not depend
on which program finished last) and sets the counter back to zero -- else by a second launch, stage 2.

Host side: the first call with a given signature validates the inputs and builds a `_DecodePlan`; later calls
go straight to the launches (kernels/launch_cache.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.checks import check_decode_inputs
from kernels.launch_cache import CachedLauncher, CompiledLaunch, current_stream
from kernels.new_token_rope import NewTokens, rope_lanes, rotated_q, store_new_kv
from kernels.rmsnorm import row_rstd
from kernels.split_heuristic import (
    MAX_SPLITS,
    KernelConfig,
    choose_launch,
    int32_offsets,
    num_sms,
    split_size,
)
from kernels.split_merge import MAX_FUSED_CHUNKS, merge_chunk, merge_group, merge_stage2
from kernels.workspace import DecodeWorkspace

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30


@triton.jit
def _split_range(seq_len, window, split, num_splits, BLOCK_N: tl.constexpr):
    """Token range [lo, hi) of this split from the sequence's own length (kernels/split_heuristic.py's
    split_size over the visible range [seq_len - window, seq_len))."""
    vis_lo = tl.maximum(seq_len - window, 0)
    per = tl.cdiv(tl.cdiv(seq_len - vis_lo, num_splits), BLOCK_N) * BLOCK_N
    lo = vis_lo + split * per
    hi = tl.minimum(lo + per, seq_len)
    return lo, hi


@triton.jit
def _block_ids(table_row, pos, limit, BLOCK_SIZE: tl.constexpr, OFFSETS_32: tl.constexpr):
    """(BN,) physical block of each token position, as the offset type (0 at `pos >= limit`: never read)."""
    blk = tl.load(table_row + pos // BLOCK_SIZE, mask=pos < limit, other=0)
    return blk.to(tl.int32) if OFFSETS_32 else blk.to(tl.int64)


@triton.jit
def _kv_tile(base, blk, pos, valid, offs_d, d_mask, stride_b, stride_t, stride_d,
             BLOCK_SIZE: tl.constexpr):
    """(BN, DP) tile of K or V for token positions `pos` living in blocks `blk`."""
    tok = (pos % BLOCK_SIZE).to(blk.dtype)
    offs = blk[:, None] * stride_b + tok[:, None] * stride_t + offs_d[None, :] * stride_d
    return tl.load(base + offs, mask=valid[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One tile of online softmax: q (GP, DP); k, v (BN, DP) of the tokens marked `valid` (BN,); running
    max m (GP,) in log2 units, sum l (GP,) and unnormalised output acc (GP, DP). Returns the new m, l, acc."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale      # (GP, BN)
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))                          # finite: a tile has a valid pos
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# sizes that change between calls of one plan shape are not specialised on (see kernels/paged_prefill.py)
@triton.jit(do_not_specialize=["window", "num_splits", "table_split_tokens", "table_tokens"])
def _paged_decode_stage1(
    Q, K, V, BLOCK_TABLES, SEQ_LENS, O_PART, LSE_PART, OUT, TICKETS, COS, SIN, SLOTS, RESIDUAL, BIAS,
    qk_scale, window, num_splits, table_split_tokens, table_tokens,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_tb, stride_ob, stride_oh, stride_od, stride_cos, stride_r, eps,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLITS_FROM_TABLE: tl.constexpr, OFFSETS_32: tl.constexpr,
    MERGE: tl.constexpr, MERGE_GROUP_PAD: tl.constexpr, MERGE_BLOCK_S: tl.constexpr,
    MERGE_CHUNK_S: tl.constexpr,
    NEW_TOKENS: tl.constexpr, NORM: tl.constexpr, HIDDEN: tl.constexpr, H_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # MERGE: 0 = one split (write the output), 1 = write partials (stage 2 merges), 2 = merge in this launch
    # NEW_TOKENS: Q is the qkv rows as projected (kernels/new_token_rope.py): COS, SIN (B, D/2), SLOTS (B,),
    # RESIDUAL (B, HIDDEN) if NORM, BIAS if HAS_BIAS; else those five are unread
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)                                      # (BN,)
    table_row = BLOCK_TABLES + seq.to(tl.int64) * stride_tb

    # -- this split's token range, and the block ids of its first tile
    if SPLITS_FROM_TABLE:
        # the split size follows from the table width, so these block ids load alongside seq_len rather
        # than after it; entries past seq_len are never dereferenced
        lo = split * table_split_tokens
        blk = _block_ids(table_row, lo + offs_n, table_tokens, BLOCK_SIZE, OFFSETS_32)
        seq_len = tl.load(SEQ_LENS + seq).to(tl.int32)
        hi = tl.minimum(lo + table_split_tokens, seq_len)
    else:
        seq_len = tl.load(SEQ_LENS + seq).to(tl.int32)
        lo, hi = _split_range(seq_len, window, split, num_splits, BLOCK_N)
        blk = _block_ids(table_row, lo + offs_n, hi, BLOCK_SIZE, OFFSETS_32)

    # -- the query rows of this KV head: (GP, DP)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    if NEW_TOKENS:
        row = Q + seq.to(tl.int64) * stride_qb                          # (Hq + 2 Hkv) D contiguous values
        scale = 1.0
        if NORM:  # the folded pre-attention norm's row scale
            scale = row_rstd(RESIDUAL + seq.to(tl.int64) * stride_r, eps, HIDDEN, H_BLOCK)
        first, partner, cos, sin = rope_lanes(COS + seq * stride_cos, SIN + seq * stride_cos, offs_d, d_mask,
                                              HEAD_DIM // 2)
        q = rotated_q(row, BIAS, heads, offs_d, g_mask[:, None] & d_mask[None, :], first, partner, cos, sin,
                      scale, HEAD_DIM, HAS_BIAS)
        last = seq_len - 1
        slot = tl.load(SLOTS + seq).to(tl.int64)
        # the split that reads the new token stores it first (split 0 where no token is read: seq_len 0)
        if (((lo <= last) & (last < hi)) | ((last < 0) & (split == 0))) & (slot >= 0):
            new_k = k_base + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt
            new_v = v_base + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt
            q_heads = num_kv_heads * GROUP
            store_new_kv(row, BIAS, new_k, new_v, (q_heads + kvh) * HEAD_DIM,
                         (q_heads + num_kv_heads + kvh) * HEAD_DIM,
                         offs_d, d_mask, first, partner, cos, sin, scale, stride_kd, stride_vd, HAS_BIAS)
        tl.debug_barrier()  # the stores reach every thread of the program before the tile loop's loads
    else:
        q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # -- the tile loop: online softmax over [lo, hi)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)              # running max (log2 units)
    l_i = tl.zeros([GROUP_PAD], tl.float32)                             # running sum
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)               # unnormalised output
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k = _kv_tile(k_base, blk, pos, valid, offs_d, d_mask, stride_kb, stride_kt, stride_kd, BLOCK_SIZE)
        v = _kv_tile(v_base, blk, pos, valid, offs_d, d_mask, stride_vb, stride_vt, stride_vd, BLOCK_SIZE)
        blk = _block_ids(table_row, pos + BLOCK_N, hi, BLOCK_SIZE, OFFSETS_32)     # the next tile's
        m_i, l_i, acc = _softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    # -- the output, or this split's partial and its LSE
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]                          # empty split / seq_len 0 -> zeros
    row_mask = g_mask[:, None] & d_mask[None, :]
    if MERGE == 0:
        out_ptrs = OUT + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=row_mask)
    else:
        # partials are ours and contiguous: o (B, Hq, S, D), lse (B, Hq, S)
        hq = num_kv_heads * GROUP
        seq_part = O_PART + seq.to(tl.int64) * hq * num_splits * HEAD_DIM
        seq_lse = LSE_PART + seq.to(tl.int64) * hq * num_splits
        p_ptrs = seq_part + heads[:, None] * (num_splits * HEAD_DIM) + split * HEAD_DIM + offs_d[None, :]
        tl.store(p_ptrs, o, mask=row_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(seq_lse + heads * num_splits + split, lse, mask=g_mask)
        if MERGE == 2:
            # every thread's partial stores are done (barrier) before the release of the ticket; the
            # acquire of the last ticket orders the merge's loads after all other splits' releases
            tl.debug_barrier()
            counter = TICKETS + seq * num_kv_heads + kvh
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                merge_group(seq_part, seq_lse, OUT + seq * stride_ob, kvh * GROUP, GROUP, num_splits,
                            num_splits * HEAD_DIM, HEAD_DIM, 1, num_splits, 1, stride_oh, stride_od,
                            offs_d, d_mask, MERGE_GROUP_PAD, HEAD_DIM_PAD, MERGE_BLOCK_S, MERGE_CHUNK_S)
                tl.store(counter, 0)         # every ticket drawn: back to zero for the next launch


_stage1 = CachedLauncher(_paged_decode_stage1, num_tensors=14)


class _DecodePlan:
    """Everything about one call signature that does not depend on the data: grid, split count, tile config,
    strides, constexprs, and (after the first call) the bound compiled kernels. A call then costs one
    partial-buffer allocation and one or two direct launches. q (B, Hq, D); caches (N, bs, Hkv, D)."""

    def __init__(self, q, k_cache, v_cache, block_tables, out, scale, window, num_splits,
                 cfg: KernelConfig, with_workspace: bool, splits_from_table: bool, new: NewTokens | None):
        bsz, hq, d = q.shape
        hkv, block_size = k_cache.shape[2], k_cache.shape[1]
        self.bsz, self.hkv, self.d = bsz, hkv, d
        self.pairs = bsz * hkv                              # (sequence, KV head) counters a merge uses
        self.device_index = q.get_device()
        d_pad = triton.next_power_of_2(d)
        block_s = triton.next_power_of_2(num_splits)
        group_pad = triton.next_power_of_2(hq // hkv)
        chunk1 = merge_chunk(block_s, group_pad * d_pad)                         # in-launch: GROUP heads
        self.merge = 0 if num_splits == 1 else (
            2 if with_workspace and block_s // chunk1 <= MAX_FUSED_CHUNKS else 1)
        table_tokens = block_tables.shape[1] * block_size
        out_strides = out.stride() if out is not None else (hq * d, d, 1)         # ours are contiguous
        self.kw1 = dict(GROUP=hq // hkv, GROUP_PAD=max(16, group_pad), HEAD_DIM=d, HEAD_DIM_PAD=d_pad,
                        BLOCK_SIZE=block_size, BLOCK_N=cfg.block_n,
                        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                        SPLITS_FROM_TABLE=(splits_from_table or num_splits == 1) and window == NO_WINDOW,
                        OFFSETS_32=int32_offsets(block_size, num_splits) and _fits_int32(k_cache, v_cache),
                        MERGE=self.merge, MERGE_GROUP_PAD=group_pad, MERGE_BLOCK_S=block_s,
                        MERGE_CHUNK_S=chunk1, **_new_token_constexprs(new),
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        self.kw2 = dict(HEAD_DIM=d, HEAD_DIM_PAD=d_pad, BLOCK_S=block_s, CHUNK_S=merge_chunk(block_s, d_pad),
                        num_warps=4, num_stages=1)
        self.part_numel = bsz * hq * num_splits * d          # o (B, Hq, S, D) then lse (B, Hq, S), fp32
        self.ints1 = (scale * LOG2E, window, num_splits, split_size(table_tokens, num_splits, cfg.block_n),
                      table_tokens, *q.stride(), *k_cache.stride(), *v_cache.stride(),
                      block_tables.stride(0), *out_strides, *_new_token_ints(new))
        self.ints2 = (num_splits, hq, *out_strides)
        self.grid1 = (hkv, bsz, num_splits)
        self.grid2 = (bsz, hq, 1)
        self.bound = None                                   # (stage-1, stage-2) CompiledLaunch once compiled

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, out, workspace, new: NewTokens | None):
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.bsz == 0:
            return out
        work = None if self.merge == 0 else torch.empty(self.part_numel + self.part_numel // self.d,
                                                        device=q.device, dtype=torch.float32)
        tickets = out                                       # a placeholder pointer unless merged in-launch
        if self.merge == 2:
            if workspace.capacity < self.pairs or workspace.device_index != self.device_index:
                workspace.check(q, self.hkv)
            tickets = workspace.tickets
        extras = _new_token_tensors(new, q)
        if self.bound is None or not q.is_cuda:
            return self._first_call(q, k_cache, v_cache, block_tables, seq_lens, out, work, tickets, extras)
        stream = current_stream(self.device_index)
        o_ptr = out.data_ptr()
        w_ptr = o_ptr if work is None else work.data_ptr()
        l_ptr = o_ptr if work is None else w_ptr + 4 * self.part_numel
        stage1, stage2 = self.bound
        stage1(self.grid1, stream, (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                    block_tables.data_ptr(), seq_lens.data_ptr(), w_ptr, l_ptr, o_ptr,
                                    tickets.data_ptr(), *(t.data_ptr() for t in extras), *self.ints1,
                                    *self.tail1))
        if stage2 is not None:
            stage2(self.grid2, stream, (w_ptr, l_ptr, o_ptr, *self.ints2, *self.tail2))
        return out

    def _first_call(self, q, k_cache, v_cache, block_tables, seq_lens, out, work, tickets, extras):
        """Through the JIT with tensors (compiling if needed); binds the compiled kernels for later calls."""
        o_part = lse_part = out
        if work is not None:
            o_part, lse_part = work[:self.part_numel], work[self.part_numel:]
        args1 = (q, k_cache, v_cache, block_tables, seq_lens, o_part, lse_part, out, tickets, *extras,
                 *self.ints1)
        bound1 = _stage1(self.grid1, *args1, **self.kw1)
        bound2 = None
        if self.merge == 1:
            bound2 = merge_stage2(self.grid2[:2], o_part, lse_part, out, *self.ints2, **self.kw2)
        if isinstance(bound1, CompiledLaunch):
            self.tail1 = _stage1.tail(len(args1), self.kw1)
            self.tail2 = merge_stage2.tail(3 + len(self.ints2), self.kw2) if bound2 is not None else ()
            self.bound = (bound1, bound2)
        return out


def _new_token_tensors(new: NewTokens | None, q) -> tuple:
    """COS, SIN, SLOTS, RESIDUAL, BIAS of the stage-1 launch (q where a pointer is unread)."""
    if new is None:
        return (q,) * 5
    return (new.cos, new.sin, new.slot_mapping, q if new.norm_of is None else new.norm_of,
            q if new.bias is None else new.bias)


def _new_token_constexprs(new: NewTokens | None) -> dict:
    """NEW_TOKENS, NORM, HIDDEN, H_BLOCK, HAS_BIAS of the stage-1 launch."""
    norm = new is not None and new.norm_of is not None
    hidden = new.norm_of.shape[1] if norm else 1
    return dict(NEW_TOKENS=new is not None, NORM=norm, HIDDEN=hidden, H_BLOCK=triton.next_power_of_2(hidden),
                HAS_BIAS=new is not None and new.bias is not None)


def _new_token_ints(new: NewTokens | None) -> tuple:
    """stride_cos (sin's too), stride_r, eps of the stage-1 launch."""
    if new is None:
        return 0, 0, 0.0
    return new.cos.stride(0), 0 if new.norm_of is None else new.norm_of.stride(0), float(new.eps)


def _fits_int32(*caches) -> bool:
    """Whether every element offset of each cache from its base (its largest: sum of (size - 1) * stride; the
    kernel adds a head's offset to the 64-bit base pointer first) stays below 2**31."""
    return all(sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0) < 2**31
               for t in caches)


# one plan per call signature; bounded so a server with ever-changing batch sizes cannot grow it forever
_PLANS: dict = {}
MAX_PLANS = 4096


def _signature(*tensors) -> tuple:
    """What a plan depends on: shapes, strides, dtypes, devices and 16-byte alignment of each tensor."""
    return tuple(None if t is None else
                 (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15 == 0) for t in tensors)


def _new_token_signature(new: NewTokens | None) -> tuple | None:
    """What a plan depends on of new tokens: their tensors as _signature sees them, and eps."""
    if new is None:
        return None
    return _signature(new.cos, new.sin, new.slot_mapping, new.norm_of, new.bias), float(new.eps)


def _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out, sliding_window, num_splits, workspace,
                  new_tokens):
    check_decode_inputs("triton", q, k_cache, v_cache, block_tables, seq_lens, out)
    if new_tokens is not None:
        new_tokens.check(q, k_cache, v_cache)
    if seq_lens.stride() != (1,) and q.shape[0] > 1:
        raise ValueError("seq_lens must be contiguous")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:  # the kernel walks a row's entries by 1
        raise ValueError(f"block_tables rows must be contiguous, got strides {tuple(block_tables.stride())}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if num_splits is not None and not 1 <= int(num_splits) <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS} or None, got {num_splits}")
    if workspace is not None:
        if not isinstance(workspace, DecodeWorkspace):
            raise ValueError(f"workspace must be a kernels.DecodeWorkspace or None, got {type(workspace)}")
        workspace.check(q, k_cache.shape[2])


def _make_plan(q, k_cache, v_cache, block_tables, seq_lens, out, scale, sliding_window, num_splits, config,
               workspace, new_tokens) -> _DecodePlan:
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out, sliding_window, num_splits, workspace,
                  new_tokens)
    d, block_size, hkv = q.shape[-1], k_cache.shape[1], k_cache.shape[2]
    window = NO_WINDOW if sliding_window is None else int(sliding_window)
    # a fixed split count promises batch invariance: its split size follows the sequence's own length
    splits_from_table = (num_splits is None or config is not None) and window == NO_WINDOW
    max_len = min(block_tables.shape[1] * block_size, window)
    cfg, num_splits = choose_launch(q.device, q.shape[0], hkv, max_len, d, q.element_size(),
                                    num_sms(q.device), num_splits, config)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return _DecodePlan(q, k_cache, v_cache, block_tables, out, scale, window, num_splits, cfg,
                       workspace is not None, splits_from_table, new_tokens)


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale=None,
                                  sliding_window=None, num_splits=None, out=None, config=None,
                                  workspace=None, new_tokens=None):
    """Checked public wrapper: returns out (B, Hq, D). The first call with a given signature validates the
    inputs and builds a plan; later calls with the same signature go straight to the launches.
    workspace: a kernels.DecodeWorkspace; with one, the last split program of each (sequence, KV head)
    merges the splits inside the stage-1 launch (one launch), without one a stage-2 launch merges them.
    config: a KernelConfig to use instead of the table's (benchmarks and tests).
    new_tokens: a kernels.new_token_rope.NewTokens whose qkv rows q's heads are; the launch rotates q and
    stores the new K/V itself."""
    key = (_signature(q, k_cache, v_cache, block_tables, seq_lens, out), scale, sliding_window, num_splits,
           config, workspace is not None, _new_token_signature(new_tokens))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(q, k_cache, v_cache, block_tables, seq_lens, out, scale, sliding_window, num_splits,
                          config, workspace, new_tokens)
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan(q, k_cache, v_cache, block_tables, seq_lens, out, workspace, new_tokens)
