"""Triton bad-words ban: in place, each word's last token held back where a row's recent tokens are its
others.

The tables are server/engine/bad_words.py's: words (R, B, L) int32, each row's words right-aligned (the last
token in column L - 1, PAD = -1 on their left, an empty slot all PAD); recent (R, L - 1) int64, each row's
last L - 1 sampled tokens (NONE = -2 where it has sampled fewer). logits (S, V), the step's, of rows (S,)
int64. A word matches where each of its first L - 1 columns is PAD or equals recent's column; its last token
(when >= 0) then becomes min(logit, floor). Program s reads row rows[s]'s B x L words, BLOCK_B at a time,
and writes only the banned logits; two words of one row ending in one token write the same value.

One launch where the torch path (BadWords.ban_, on CPU) takes a gather of the rows' words and recent tokens,
the compare, the reduction and a scatter: about eight kernels a step. Measured (H100, torch 2.11, Triton 3.6,
`tools/closed_loop_ab.sh` with LOOPS="64:256:bad_words 64:256", 16 bad words a request): the engine's loop
at 64 in flight 22,579 / 22,951 tok/s with the torch path, 24,205 / 24,244 with this kernel; the free loop
24,950 / 24,871 against 24,876 / 24,862 (docs/benchmarks/structured_outputs_h100.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

BLOCK_B = 16  # words a program compares at once
MAX_WORD_TOKENS = 64  # the columns a program reads of a word (SamplingParams' bound): one compiled variant


@triton.jit(do_not_specialize=["stride_logits", "B", "L"])  # one variant whatever the table's shape
def _ban_kernel(LOGITS, ROWS, WORDS, RECENT, stride_logits, B, L, floor,
                BLOCK_B: tl.constexpr, BLOCK_L: tl.constexpr):
    s = tl.program_id(0)
    row = tl.load(ROWS + s)
    cols = tl.arange(0, BLOCK_L)  # (BLOCK_L,) a word's columns
    before = cols < L - 1
    recent = tl.load(RECENT + row * (L - 1) + cols, mask=before, other=-2)  # (BLOCK_L,)
    for b0 in range(0, B, BLOCK_B):
        slots = b0 + tl.arange(0, BLOCK_B)  # (BLOCK_B,)
        base = WORDS + (row * B + slots[:, None]) * L + cols[None, :]  # (BLOCK_B, BLOCK_L)
        words = tl.load(base, mask=(slots[:, None] < B) & before[None, :], other=-1)
        same = (words == -1) | (words == recent[None, :])
        match = tl.min(same.to(tl.int32), axis=1) == 1  # (BLOCK_B,) every earlier column matches
        last = tl.load(WORDS + (row * B + slots) * L + L - 1, mask=slots < B, other=-1)  # (BLOCK_B,)
        ban = match & (last >= 0)
        target = LOGITS + s * stride_logits + tl.where(ban, last, 0)
        logit = tl.load(target, mask=ban, other=0.0)
        tl.store(target, tl.minimum(logit, floor).to(logit.dtype), mask=ban)


_ban = CachedLauncher(_ban_kernel, num_tensors=4)


def ban_(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor, recent: torch.Tensor,
         floor: float) -> torch.Tensor:
    """logits (S, V) of rows (S,) int64, in place -> them, each matching word's last token at min(logit,
    floor); words (R, B, L) int32 and recent (R, L - 1) int64 contiguous (L >= 1)."""
    if logits.stride(1) != 1 or not words.is_contiguous() or not recent.is_contiguous():
        raise ValueError("ban_ takes logits with contiguous rows and contiguous word and recent tables")
    if words.dtype != torch.int32 or recent.dtype != torch.int64 or recent.shape[1] != words.shape[2] - 1:
        raise ValueError(f"words (R, B, L) int32 and recent (R, L - 1) int64, got {tuple(words.shape)} "
                         f"{words.dtype}, {tuple(recent.shape)} {recent.dtype}")
    num_words, word_len = words.shape[1], words.shape[2]
    if not 1 <= word_len <= MAX_WORD_TOKENS:
        raise ValueError(f"words of 1 to {MAX_WORD_TOKENS} tokens, got a table of {word_len}")
    if rows.numel() and num_words:
        _ban((rows.shape[0],), logits, rows.long(), words, recent, logits.stride(0), num_words, word_len,
             float(floor), BLOCK_B=BLOCK_B, BLOCK_L=MAX_WORD_TOKENS, num_warps=4, num_stages=1)
    return logits


def warm_up(device: torch.device) -> None:
    """Compiles the kernel's one variant (fp32 logits, as the sampler bans), before serving."""
    words = torch.tensor([[[3, 4]]], dtype=torch.int32, device=device)
    ban_(torch.zeros(1, 8, device=device), torch.zeros(1, dtype=torch.int64, device=device), words,
         torch.full((1, 1), 3, dtype=torch.int64, device=device), -1e30)
