"""Triton row argmax of a step's logits: the greedy decode step's token ids, torch.argmax's answer.

torch.argmax over (S, V) logits runs one block per row: at V = 128256 and 64 rows of bf16 (16 MB) it takes
27 µs on an H200, this kernel 7.5 (tools/argmax_bench; docs/benchmarks/decode_forward_h200.md). The work
splits two ways:
  1. program (row, c) walks chunk c of the row in BLOCK-wide tiles, each lane keeping its own running max
     and the first column holding it (no reduction inside the loop), and writes the chunk's (key, column)
     from the lanes' maxima;
  2. program row merges its chunks: the largest key, the smallest column among ties.
The chunks per row grow as the rows shrink so that about TARGET_PROGRAMS programs read the logits.

The comparison key reproduces torch.argmax exactly: an int32 that orders floats as their values do (the bit
pattern, its magnitude bits flipped when negative), -0.0 taken as +0.0, and NaN above everything (torch's
argmax returns the first NaN); ties go to the first column. The reference is torch.argmax itself, over the
widened values (tests/test_kernels_argmax.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher, CompiledLaunch, current_stream

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# tile, warps and program target: the best of 18 settings in bf16 at 1/16/64/256 rows of 128256 on an H200
# (tools/argmax_bench --sweep; docs/benchmarks/argmax_h200.json): 3.0/4.7/7.5/24.0 µs
BLOCK = 2048  # columns of one tile: 8 warps load 8 per thread (one 16-byte load in bf16)
NUM_WARPS = 8
TARGET_PROGRAMS = 512  # stage-1 programs aimed at: ~4 per SM on a 132-SM H200
KEY_NAN = tl.constexpr(2**31 - 1)  # above +inf's key (0x7F800000)


@triton.jit
def _order_key(x):
    """(BLOCK,) floats -> int32 keys ordered as the values, -0.0 as +0.0, NaN the largest."""
    x = tl.where(x == 0.0, 0.0, x.to(tl.float32))
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x != x, KEY_NAN, key)


@triton.jit
def _chunk_argmax_kernel(LOGITS, PART_KEY, PART_COL, stride_row, V, chunk, num_chunks,
                         BLOCK: tl.constexpr):
    """Program (row, c): columns [c * chunk, min((c + 1) * chunk, V)) -> PART_KEY/PART_COL[row, c].
    Each lane keeps its running max as a float and the first column holding it: a later value replaces it
    only when strictly larger, or when it is the lane's first NaN (a NaN max stays: NaN > x never holds);
    the order keys are taken once, over the lanes, after the loop (keys inside the loop would make the kernel
    bound by its integer work, not by memory: 10.5 µs at 64 rows of 128256, bf16 or fp32 alike)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    start = c * chunk
    end = tl.minimum(start + chunk, V)
    max_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    col_lane = start + lanes  # an all -inf chunk: its first column
    for tile in range(start, end, BLOCK):
        cols = tile + lanes
        x = tl.load(LOGITS + row * stride_row + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        take = (x > max_lane) | ((x != x) & (max_lane == max_lane))
        col_lane = tl.where(take, cols, col_lane)
        max_lane = tl.where(take, x, max_lane)
    key_lane = tl.where(col_lane < end, _order_key(max_lane), -2**31)
    best = tl.max(key_lane, 0)
    col = tl.min(tl.where(key_lane == best, col_lane, 2**31 - 1), 0)
    tl.store(PART_KEY + row * num_chunks + c, best)
    tl.store(PART_COL + row * num_chunks + c, col)


@triton.jit
def _merge_chunks_kernel(PART_KEY, PART_COL, OUT, num_chunks, BLOCK_C: tl.constexpr):
    """Program row: the largest chunk key, the smallest column among ties -> OUT[row] (int64)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    key = tl.load(PART_KEY + row * num_chunks + c, mask=mask, other=-2**31)
    col = tl.load(PART_COL + row * num_chunks + c, mask=mask, other=2**31 - 1)
    best = tl.max(key, 0)
    tl.store(OUT + row, tl.min(tl.where(key == best, col, 2**31 - 1), 0).to(tl.int64))


_chunk_argmax = CachedLauncher(_chunk_argmax_kernel, num_tensors=3)
_merge_chunks = CachedLauncher(_merge_chunks_kernel, num_tensors=3)


def num_chunks(rows: int, vocab: int) -> int:
    """Chunks per row: enough that rows * chunks reaches TARGET_PROGRAMS, at most one tile each."""
    return max(1, min(triton.cdiv(vocab, BLOCK), triton.cdiv(TARGET_PROGRAMS, rows)))


def _chunking(rows: int, vocab: int) -> tuple[int, int]:
    """-> (columns per chunk, chunks per row): whole tiles per chunk, about num_chunks(rows, vocab) chunks."""
    chunk = triton.cdiv(triton.cdiv(vocab, BLOCK), num_chunks(rows, vocab)) * BLOCK
    return chunk, triton.cdiv(vocab, chunk)


def warm_up(max_rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Compiles every variant argmax_rows launches for 1..max_rows rows of (rows, vocab) `dtype` logits
    with unit row stride over a contiguous buffer (a Triton compile mid-serving stalls every stream);
    -> the number of distinct chunkings run."""
    logits = torch.zeros(max_rows, vocab, dtype=dtype, device=device)
    first_rows = {}  # chunking -> the fewest rows that launch it
    for rows in range(1, max_rows + 1):
        first_rows.setdefault(_chunking(rows, vocab), rows)
    for rows in first_rows.values():
        argmax_rows(logits[:rows])
    return len(first_rows)


class _Plan:
    """The two launches for one logits signature (shape, row stride, dtype, device, alignment, settings):
    sizes, grids and integer arguments computed once; after the first call (through the JIT) the compiled
    kernels are launched directly with raw pointers, as kernels/paged_decode.py's plans do. A step's argmax
    is then two torch.empty and two launches of host work."""

    def __init__(self, logits: torch.Tensor):
        rows, vocab = logits.shape
        chunk, chunks = _chunking(rows, vocab)
        # the columns' half starts 16-byte aligned whatever rows x chunks is: Triton specializes a kernel
        # on its pointers' alignment, and warm_up compiles each chunking at one row count only (an
        # unaligned half compiled the kernels again mid-serving, at 35 and 20 rows on an H200)
        self.rows, self.parts = rows, -(-rows * chunks // 4) * 4
        self.device_index = logits.get_device()
        self.grid1, self.grid2 = (rows, chunks, 1), (rows, 1, 1)
        self.ints1, self.ints2 = (logits.stride(0), vocab, chunk, chunks), (chunks,)
        self.kw1 = dict(BLOCK=BLOCK, num_warps=NUM_WARPS, num_stages=1)
        self.kw2 = dict(BLOCK_C=triton.next_power_of_2(chunks), num_warps=1, num_stages=1)
        self.bound = None  # (stage 1, stage 2) CompiledLaunch once compiled, with their constexpr tails

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.rows, dtype=torch.int64, device=logits.device)
        parts = torch.empty(2, self.parts, dtype=torch.int32, device=logits.device)  # keys, then columns
        if self.bound is None or not logits.is_cuda:
            return self._first_call(logits, parts, out)
        stage1, tail1, stage2, tail2 = self.bound
        stream = current_stream(self.device_index)
        keys = parts.data_ptr()
        cols = keys + 4 * self.parts
        stage1(self.grid1, stream, (logits.data_ptr(), keys, cols, *self.ints1, *tail1))
        stage2(self.grid2, stream, (keys, cols, out.data_ptr(), *self.ints2, *tail2))
        return out

    def _first_call(self, logits: torch.Tensor, parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Through the JIT with tensors (compiling if needed); binds the compiled kernels for later calls."""
        args1 = (logits, parts[0], parts[1], *self.ints1)
        args2 = (parts[0], parts[1], out, *self.ints2)
        bound1 = _chunk_argmax(self.grid1[:2], *args1, **self.kw1)
        bound2 = _merge_chunks(self.grid2[:1], *args2, **self.kw2)
        if isinstance(bound1, CompiledLaunch) and isinstance(bound2, CompiledLaunch):
            self.bound = (bound1, _chunk_argmax.tail(len(args1), self.kw1),
                          bound2, _merge_chunks.tail(len(args2), self.kw2))
        return out


# one plan per call signature; bounded so that ever-new shapes cannot grow it forever
_PLANS: dict = {}
MAX_PLANS = 4096


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits (S, V) fp32/bf16/fp16 with unit stride over V -> (S,) int64: each row's argmax, as
    torch.argmax(logits, dim=-1) gives it (first index of the max; NaN counts as the max)."""
    key = (logits.shape, logits.stride(), logits.dtype, logits.device, logits.data_ptr() & 15 == 0,
           BLOCK, NUM_WARPS, TARGET_PROGRAMS)
    plan = _PLANS.get(key)
    if plan is None:
        _check(logits)
        if logits.shape[0] == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(logits)
    return plan(logits)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in DTYPES:
        raise ValueError(f"logits must be (S, V) in {DTYPES}, got {tuple(logits.shape)} {logits.dtype}")
    if logits.shape[1] == 0 or logits.shape[1] >= 2**31 or logits.stride(1) != 1:
        raise ValueError(f"logits must have 0 < V < 2**31 and unit stride over V, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
