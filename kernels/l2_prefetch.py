"""L2 prefetch of a tensor's bytes (CUDA only): `prefetch.global.L2` of every 128-byte line, nothing returned.

Why: in a decode step the attention of a short context is latency bound (at batch 1, 1.2 MB of K/V in ~5 us),
so the DRAM bandwidth idles while it runs, and the projection after it starts cold. Launched on a side
stream of the captured graph beside the attention, this kernel pulls the next projections' weights into L2
in that idle time; the GEMV that follows then reads them from L2. It moves no data into registers and
writes nothing: a prefetch is a hint the memory system may drop, so correctness never depends on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE = 128            # bytes a prefetch names (one L2 line)
LINES_PER_PROGRAM = 1024  # 128 KiB a program: 8 prefetches a thread at 4 warps


@triton.jit
def _l2_prefetch_kernel(BASE, n_lines, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Program p prefetches lines [p LINES, (p + 1) LINES) of the range at BASE (uint8); the last program's
    tail repeats the final line (a prefetch writes nothing, so a repeat costs one request)."""
    line = tl.program_id(0) * LINES + tl.arange(0, LINES)
    line = tl.minimum(line, n_lines - 1)
    ptrs = BASE + line.to(tl.int64) * 128
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None, evict_last: bool = False) -> None:
    """Prefetches the first `nbytes` (default: all) of contiguous CUDA tensor t into L2 on the current
    stream."""
    if t.device.type != "cuda" or not t.is_contiguous():
        raise ValueError(f"l2_prefetch takes a contiguous CUDA tensor, got {t.device} "
                         f"contiguous={t.is_contiguous()}")
    total = t.numel() * t.element_size()
    nbytes = total if nbytes is None else min(int(nbytes), total)
    if nbytes <= 0:
        return
    n_lines = triton.cdiv(nbytes, LINE)
    _l2_prefetch_kernel[(triton.cdiv(n_lines, LINES_PER_PROGRAM),)](
        t.view(-1).view(torch.uint8), n_lines, LINES=LINES_PER_PROGRAM, EVICT_LAST=evict_last, num_warps=4)
