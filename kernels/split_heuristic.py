"""How many KV splits and which tile config the paged-decode kernel launches with.

Split rule (both modes): a sequence's visible range [lo, seq_len) is cut into `num_splits` pieces of
ceil(ceil((seq_len - lo) / num_splits) / BLOCK_N) * BLOCK_N tokens each. The piece size depends only on the
sequence's own length, so with a fixed `num_splits` (batch-invariant mode) a sequence's output is bitwise the
same whatever else is in the batch. The heuristic picks `num_splits` from the SM count, batch and the
table's length bound (no device sync): long single sequences must fill the GPU, large batches need no split.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kernels import l2_hint

# Programs per SM the heuristic aims for: one full wave of PROGRAMS_PER_SM for several sequences, about
# SINGLE_SEQUENCE_PROGRAMS_PER_SM (rounded) for one where the split config's cp.async loads carry the L2 hint
# (a full wave where they cannot: register prefetch wants it); a split is never shorter than MIN_SPLIT_TOKENS
# (stage-2 cost and per-program start-up dominate below that). Measured on the H200, docs/kernel_notes.md
# runs 12, 31, 34.
PROGRAMS_PER_SM = 2
SINGLE_SEQUENCE_PROGRAMS_PER_SM = 1.7
# from this many splits on, a toolchain that drops the hint on cp.async streams through register prefetch
REGISTER_PREFETCH_MIN_SPLITS = 24
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 256
MAX_FIXED_SPLITS = 256
INTERPRETER_SMS = 4


@dataclass(frozen=True)
class KernelConfig:
    block_n: int      # tokens per K/V tile (independent of the cache's block_size)
    num_warps: int
    num_stages: int
    table_in_loop: bool = False  # block ids loaded in the loop (the pipeliner stages them) vs a tile ahead
    heads_fastest: bool = False  # grid (Hkv, B, S) instead of (B, Hkv, S)
    early_table: bool = False    # split size from the table width: first block ids load alongside seq_len
    pdl: bool = False        # launch stage 2 with programmatic dependent launch (CUDA only)
    pdl_wait: bool = False   # launch stage 1 itself with PDL: its CTAs start while the kernel before it
                             # drains, and wait (griddepcontrol.wait) for that kernel before any memory access
    offsets_32: bool = True  # int32 cache offsets where both caches allow it (fewer address instructions)
    reg_prefetch: bool = False  # plain loads one tile ahead into registers, not Triton's cp.async pipeline
    evict_first: bool = False   # L2 evict-first hint on K/V loads (cp.async: only with ptxas >= 13.4.59)

    def label(self) -> str:
        """Short name for tables: tile/warps/stages, a letter per flag that is on, /i64 for int64 offsets."""
        flags = "".join(f"/{letter}" for name, letter in FLAG_LETTERS.items() if getattr(self, name))
        return (f"{self.block_n}/{self.num_warps}w/{self.num_stages}s{flags}"
                + ("" if self.offsets_32 else "/i64"))


FLAG_LETTERS = {"table_in_loop": "T", "heads_fastest": "H", "early_table": "E", "pdl": "P",
                "reg_prefetch": "R", "evict_first": "F", "pdl_wait": "W"}


# Measured on the H200 (bf16, D=128, Hq/Hkv=4; `python -m kernels.tune`, runs 9-12 and 19 in
# docs/kernel_notes.md). One split (batch >= 64): 64-token tiles, 4 warps, 2 stages, KV heads fastest in the
# grid and the first block ids loaded alongside seq_len were best at every shape; int64 offsets, because
# int32 ones made (128, 4096) 4% slower (495.5 -> 515.9 us) for +-1% elsewhere. Several splits (few long
# sequences): 3 stages, early table, stage 2 under PDL, int32 offsets. Block sizes <= 4 (a tile spans 16+
# blocks, so address math dominates): with int32 offsets the one-split config took 498.3 us at block size 1
# against 608.6 without and 502.8 for 32-token tiles, 6 stages, ids loaded in the loop (still used with
# splits). Head dim 256 keeps its run-5 config (unswept).
_ONE_SPLIT = KernelConfig(64, 4, 2, heads_fastest=True, early_table=True, offsets_32=False)
# evict_first (runs 26-27): the L2 evict-first hint on the cp.async K/V loads; (1, 32768) 45.2 -> 41.5 us
# GPU-only. Not at one split: it made (128, 4096) 507 -> 529 us and (256, 1024) 255 -> 263. Triton 3.6 drops
# it unless its ptxas is >= 13.4.59 (kernels/l2_hint.py); so do 3.7.1 and 3.8.0 (offline PTX 8.7 / 8.8:
# plain cp.async, with ptxas 12.8 / 12.9 for sm_90).
_MANY_SPLITS = KernelConfig(64, 4, 3, heads_fastest=True, early_table=True, pdl=True, evict_first=True)
# Where the toolchain drops that hint, plain loads one tile ahead keep it (runs 23, 34): one sequence at 32
# splits, GPU-only / do_bench, (1, 32768) 43.9 / 47.3 us vs 45.2 / 47.8 for the split config at 27,
# (1, 16384) 26.0 / 28.9 vs 27.9 / 30.6; but slower with fewer splits: (2, 32768) 75.4 vs 74.6 at 16,
# (16, 4096) 78.7 vs 73.8 at 2, (1, 4096) 11.9 vs 11.8 at 16.
_MANY_SPLITS_REGISTERS = KernelConfig(64, 4, 1, heads_fastest=True, early_table=True, pdl=True,
                                      reg_prefetch=True, evict_first=True)
_TINY_BLOCKS = KernelConfig(64, 4, 2, heads_fastest=True, early_table=True)
_TINY_BLOCKS_SPLITS = KernelConfig(32, 4, 6, table_in_loop=True, heads_fastest=True, pdl=True)
_HEAD_DIM_256 = KernelConfig(block_n=32, num_warps=4, num_stages=2)
_INTERPRETER_CONFIG = KernelConfig(block_n=32, num_warps=4, num_stages=1)


def choose_config(device: torch.device, head_dim_pad: int, elem_size: int = 2, block_size: int = 16,
                  num_splits: int = 1, cp_async_hint: bool = True) -> KernelConfig:
    """Tile config from the device, head dim, element size, block size, split count and whether the
    toolchain keeps the L2 hint on cp.async (`cp_async_hint_compiles`) only.

    Never from the batch, so a fixed num_splits keeps the batch-invariance promise.
    """
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    if head_dim_pad > 128:
        cfg = _HEAD_DIM_256
    elif block_size <= 4:
        cfg = _TINY_BLOCKS if num_splits == 1 else _TINY_BLOCKS_SPLITS
    else:
        cfg = _ONE_SPLIT if num_splits == 1 else _MANY_SPLITS
        if num_splits >= REGISTER_PREFETCH_MIN_SPLITS and not cp_async_hint:
            cfg = _MANY_SPLITS_REGISTERS
    if elem_size > 2:  # fp32 tiles take twice the shared memory per stage
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
    return cfg


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_len: int, sms: int, block_n: int = 64,
                      cp_async_hint: bool = True) -> int:
    """Split count for the heuristic mode; max_len is an upper bound on a sequence's visible tokens.
    As many splits as fit in one wave of PROGRAMS_PER_SM programs per SM (rounded down: a partial second
    wave cost more than it gave, e.g. (16, 4096) took 75.4 us with 2 splits, 77-80 us with 3). One sequence
    takes fewer, about SINGLE_SEQUENCE_PROGRAMS_PER_SM per SM, where the cp.async loads carry the L2 hint:
    GPU-only, three rounds, run 31, (1, 32768) 41.3-41.8 us with 27 splits vs 42.6-42.7 with 32, (1, 16384)
    24.8-24.9 vs 25.1-25.4; while two and four sequences were faster with the full wave ((2, 32768) 75.4-75.5
    us with 16 vs 76.0-76.6 with 14). Without the hint (register prefetch) one sequence wants the full wave
    too: (1, 32768) 43.9 us with 32 splits vs 47.7 with 27 (run 34)."""
    base = max(1, batch * num_kv_heads)
    wave = PROGRAMS_PER_SM * sms // base
    single = SINGLE_SEQUENCE_PROGRAMS_PER_SM if cp_async_hint else PROGRAMS_PER_SM
    want = min(round(single * sms / base), wave) if batch == 1 else wave
    cap = max(1, max_len // max(MIN_SPLIT_TOKENS, block_n))
    splits = max(1, min(want, cap, MAX_SPLITS))
    # no split left empty by tile rounding: 33 splits of 32768 tokens round to 1024-token pieces, so the
    # 33rd would be empty (and its merge wider); measured 49.8 us there vs 46.6 with 32 splits
    per = _cdiv(_cdiv(max_len, splits), block_n) * block_n
    return max(1, _cdiv(max_len, per))


def choose_launch(device: torch.device, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                  elem_size: int, block_size: int, sms: int, cp_async_hint: bool,
                  num_splits: int | None = None,
                  config: KernelConfig | None = None) -> tuple[KernelConfig, int]:
    """(tile config, split count) of a call: the heuristic's for whichever of the two the caller left None,
    the split count first (the config depends on it). max_len bounds a sequence's visible tokens."""
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_len, sms, cp_async_hint=cp_async_hint)
    head_dim_pad = 1 << (head_dim - 1).bit_length()                    # the kernel's padded head_dim
    cfg = config or choose_config(device, head_dim_pad, elem_size, block_size, int(num_splits),
                                  cp_async_hint=cp_async_hint)
    return cfg, int(num_splits)


@functools.lru_cache(maxsize=8)
def cp_async_hint(device: torch.device) -> bool:
    """Whether the split config's cp.async loads get their L2 hint on this device's toolchain; True off CUDA
    (the interpreter has no L2 hint to lose, so its picks stay those measured with the hint)."""
    if device.type != "cuda":
        return True
    major, minor = torch.cuda.get_device_capability(device)
    return l2_hint.cp_async_hint_compiles(major * 10 + minor)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
