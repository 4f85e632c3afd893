"""Merging the KV splits of paged-decode attention by their log-sum-exp.

Each split of a (sequence, KV head) leaves, per query head, a normalised partial output o_s (D,) and its
log2-sum-exp lse_s; the merged output is sum_s 2^lse_s o_s / sum_s 2^lse_s. `merge_group` does that for a
group of query heads of one sequence with every load in flight at once. It runs either inside the stage-1
launch (the split program that draws the last ticket of a `DecodeWorkspace` merges its KV head's query heads;
see kernels/paged_decode.py) or in this file's stage-2 kernel, grid (seq, q_head), a query head a program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

# fp32 elements of partial output one merge chunk loads, (heads, CS, D): 64 registers a thread at 4 warps.
# The chunk loop is unrolled; the in-launch merge is used only up to MAX_FUSED_CHUNKS chunks (code size),
# beyond that the splits are merged by stage 2 even with a workspace.
MERGE_CHUNK_ELEMS = 8192
MAX_FUSED_CHUNKS = 8


def merge_chunk(block_s: int, row_elems: int) -> int:
    """Splits per merge chunk for BLOCK_S (splits rounded up to a power of two) and `row_elems` fp32 per split
    (heads x padded head_dim)."""
    return min(block_s, max(1, MERGE_CHUNK_ELEMS // row_elems))


@triton.jit
def merge_group(o_part, lse_part, out, first_head, num_heads, num_splits, stride_ph, stride_ps, stride_pd,
                 stride_lh, stride_ls, stride_oh, stride_od, offs_d, d_mask, GROUP_PAD: tl.constexpr,
                 HEAD_DIM_PAD: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr):
    """Merge the splits of query heads first_head + [0, num_heads): out = sum_s 2^lse_s o_s / sum_s 2^lse_s
    over the normalised partials o_s and their log2-sum-exps lse_s. o_part, lse_part, out point at one
    sequence. The chunk loop is unrolled, so every load (all heads, all splits) is in flight at once: one
    round trip to L2, not one per head and chunk. Loads bypass L1 (.cg): in the fused merge other SMs wrote
    these partials during this launch."""
    offs_g = tl.arange(0, GROUP_PAD)
    g_mask = offs_g < num_heads
    heads = first_head + offs_g                                                     # (GP,)
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_part + heads[:, None] * stride_lh + offs_s[None, :] * stride_ls,
                  mask=g_mask[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"),
                  cache_modifier=".cg")                                             # (GP, BS)
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)                                        # all splits empty
    denom = tl.sum(tl.exp2(lse - m[:, None]), 1)                                    # (GP,)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for c in tl.static_range(0, BLOCK_S, CHUNK_S):
        s = c + tl.arange(0, CHUNK_S)
        gs_mask = g_mask[:, None] & (s < num_splits)[None, :]                      # (GP, CS)
        w = tl.exp2(tl.load(lse_part + heads[:, None] * stride_lh + s[None, :] * stride_ls, mask=gs_mask,
                            other=float("-inf"), cache_modifier=".cg") - m[:, None])   # (GP, CS)
        o = tl.load(o_part + heads[:, None, None] * stride_ph + s[None, :, None] * stride_ps
                    + offs_d[None, None, :] * stride_pd, mask=gs_mask[:, :, None] & d_mask[None, None, :],
                    other=0.0, cache_modifier=".cg")                                # (GP, CS, DP)
        acc += tl.sum(o * w[:, :, None], 1)
    res = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out + heads[:, None] * stride_oh + offs_d[None, :] * stride_od, res.to(out.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _paged_decode_stage2(
    O_PART, LSE_PART, OUT, num_splits, num_q_heads, stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
):
    """Grid (seq, q_head): one query head's splits; partials contiguous, o (B, Hq, S, D), lse (B, Hq, S)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    merge_group(O_PART + seq * num_q_heads * num_splits * HEAD_DIM, LSE_PART + seq * num_q_heads * num_splits,
                OUT + seq * stride_ob, head, 1, num_splits, num_splits * HEAD_DIM, HEAD_DIM, 1, num_splits, 1,
                stride_oh, stride_od, offs_d, offs_d < HEAD_DIM, 1, HEAD_DIM_PAD, BLOCK_S, CHUNK_S)


merge_stage2 = CachedLauncher(_paged_decode_stage2, num_tensors=3)
