"""Triton step inputs: a step's per-token model inputs derived from its flat batch in one launch.

A step's host ints are (row, position, token id) per token (server.engine.batch_state). From them and the
persistent batch state on the device this kernel writes, per token, the input id (the row's last sampled
token where the id is -1), the position (padding's -1 clamped to 0), the KV slot (-1 for padding), and per
decode row the sequence length (0 for padding and for rows at or past a device decode count). With ADVANCE
(a decode graph's launch) it then rewrites its own tokens in place as the same rows' next decode step reads
them: each real position one on, each id -1 (the token this step samples, recorded on the device), so that
step needs no copy from the host (server.engine.cuda_graphs). The torch
expression of the same (BatchState._derive, its reference) is ~17 launches; at batch 1 on an H200 they
were ~40 us of a 1.1 ms decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

BLOCK = 256  # tokens per program


@triton.jit(do_not_specialize=["num_tokens", "num_decode_rows", "table_stride"])
def _step_inputs_kernel(
    TOKENS, LAST_TOKEN, TABLES, DECODE_COUNT, IDS, POSITIONS, SLOTS, SEQ_LENS,
    num_tokens, num_decode_rows, table_stride,
    BLOCK_SIZE: tl.constexpr, HAS_COUNT: tl.constexpr, ADVANCE: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                   # (BLOCK,) token indices
    live = offs < num_tokens
    rows = tl.load(TOKENS + offs, mask=live, other=0)
    pos = tl.load(TOKENS + num_tokens + offs, mask=live, other=-1)
    ids = tl.load(TOKENS + 2 * num_tokens + offs, mask=live, other=0)
    last = tl.load(LAST_TOKEN + rows, mask=live & (ids < 0), other=0)       # int64, the sampler's dtype
    valid = pos >= 0
    pos = tl.maximum(pos, 0)
    block = tl.load(TABLES + rows.to(tl.int64) * table_stride + pos // BLOCK_SIZE, mask=live, other=0)
    slot = tl.where(valid, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    tl.store(IDS + offs, tl.where(ids >= 0, ids.to(tl.int64), last), mask=live)
    tl.store(POSITIONS + offs, pos.to(tl.int64), mask=live)
    tl.store(SLOTS + offs, slot, mask=live)
    seq_len = tl.where(valid, pos + 1, 0)
    if HAS_COUNT:
        seq_len = tl.where(offs < tl.load(DECODE_COUNT), seq_len, 0)
    tl.store(SEQ_LENS + offs, seq_len, mask=offs < num_decode_rows)
    if ADVANCE:  # each program rewrites only the tokens it read; padding stays as it is
        tl.store(TOKENS + num_tokens + offs, pos + 1, mask=live & valid)
        tl.store(TOKENS + 2 * num_tokens + offs, tl.full((BLOCK,), -1, tl.int32), mask=live & valid)


_step_inputs = CachedLauncher(_step_inputs_kernel, num_tensors=8)


def step_inputs(tokens: torch.Tensor, last_token: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                num_decode_rows: int, decode_count: torch.Tensor | None = None, advance: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens (3, T) int32 [rows | positions (-1: padding) | ids (-1: the row's last sampled token)],
    contiguous; last_token (R,) int64; block_tables (R, W) int32 with unit column stride; decode_count: None
    or a (1,) int32 device count of the first num_decode_rows that are real. advance: afterwards tokens holds
    the next step's (positions >= 0 one on, ids -1; rows and padding unchanged).
    -> input_ids (T,) int64, positions (T,) int64, slots (T,) int64, seq_lens (num_decode_rows,) int32."""
    if tokens.dim() != 2 or tokens.shape[0] != 3 or not tokens.is_contiguous() or tokens.dtype != torch.int32:
        raise ValueError(f"tokens must be a contiguous (3, T) int32 tensor, got {tuple(tokens.shape)} "
                         f"{tokens.dtype}")
    if block_tables.stride(1) != 1 or last_token.dtype != torch.int64:
        raise ValueError("block_tables needs unit column stride and last_token int64")
    num_tokens = tokens.shape[1]
    if not 0 <= num_decode_rows <= num_tokens:
        raise ValueError(f"num_decode_rows {num_decode_rows} outside [0, {num_tokens}]")
    # rows of an even length: each output starts 16-byte aligned whatever T (Triton specialises on it)
    out = torch.empty(3, num_tokens + num_tokens % 2, dtype=torch.int64, device=tokens.device)
    seq_lens = torch.empty(num_decode_rows, dtype=torch.int32, device=tokens.device)
    if num_tokens:
        count = tokens if decode_count is None else decode_count  # an unread placeholder when None
        _step_inputs((triton.cdiv(num_tokens, BLOCK),), tokens, last_token, block_tables, count,
                     out[0], out[1], out[2], seq_lens, num_tokens, num_decode_rows, block_tables.stride(0),
                     BLOCK_SIZE=block_size, HAS_COUNT=decode_count is not None, ADVANCE=advance, BLOCK=BLOCK,
                     num_warps=4, num_stages=1)
    return out[0, :num_tokens], out[1, :num_tokens], out[2, :num_tokens], seq_lens
