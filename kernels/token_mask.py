"""Triton token mask: a structured output's allowed tokens applied to a step's fp32 logits, in place.

logits (S, V) fp32; samples (G,) int64, distinct rows of logits; bits (G, W) int32, W = ceil(V / 32), bit j
of word w allowing token 32 w + j (llguidance's bitmask; server/engine/grammar.py). Every token that row
samples[g] does not allow becomes -inf. Program (g, c) covers BLOCK columns of one guided row: it reads their
BLOCK / 32 words and writes -inf where a bit is clear; it never reads the logits. The sampler's torch path
(server/engine/sampler.py mask_tokens, on CPU) expands the bits over (G, V) temporaries in several passes:
0.19 ms at 64 rows of 128256 and 0.65 ms at 256 on an H100 (tools/grammar_mask_probe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

BLOCK = 4096  # columns a program masks: 128 words of bits, 16 KiB of logits at most


@triton.jit
def _mask_tokens_kernel(LOGITS, SAMPLES, BITS, stride_logits, stride_bits, V, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    row = tl.load(SAMPLES + g)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    in_row = cols < V
    words = tl.load(BITS + g.to(tl.int64) * stride_bits + cols // 32, mask=in_row, other=-1)  # (BLOCK,)
    allowed = (words >> (cols % 32)) & 1  # an arithmetic shift: bit 31 of a negative word reads as 1 too
    tl.store(LOGITS + row * stride_logits + cols, float("-inf"), mask=in_row & (allowed == 0))


_mask_tokens = CachedLauncher(_mask_tokens_kernel, num_tensors=3)


def mask_tokens_(logits: torch.Tensor, samples: torch.Tensor, bits: torch.Tensor) -> None:
    """Sets logits[samples[g], t] = -inf for each token t that bits[g] does not allow, in place."""
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"mask_tokens_ takes fp32 logits with contiguous rows, got {logits.dtype} strides "
                         f"{logits.stride()}")
    if bits.dtype != torch.int32 or bits.stride(1) != 1 or bits.shape[0] != samples.shape[0]:
        raise ValueError(f"bits must be (G, W) int32 with contiguous rows, one per sample: "
                         f"{tuple(bits.shape)} {bits.dtype}, {samples.shape[0]} samples")
    vocab = logits.shape[1]
    if bits.shape[1] * 32 < vocab:
        raise ValueError(f"bits of {bits.shape[1]} words cover {bits.shape[1] * 32} tokens, not {vocab}")
    if samples.numel():
        _mask_tokens((samples.shape[0], triton.cdiv(vocab, BLOCK)), logits, samples.long(), bits,
                     logits.stride(0), bits.stride(0), vocab, BLOCK=BLOCK, num_warps=4, num_stages=1)
