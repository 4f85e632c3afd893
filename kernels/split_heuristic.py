"""How many KV splits and which tile config the paged-decode kernel launches with.

Split rule: a sequence's visible range [lo, seq_len) is cut into `num_splits` pieces of `split_size` tokens
(equal, tile-aligned; `split_size` below is the one formula, and the kernel's `_split_range` computes the
same on the device). With a fixed `num_splits` (batch-invariant mode) the piece size depends only on the
sequence's own length, so its output is bitwise the same whatever else is in the batch. With the heuristic's
count the piece size comes from the block table's width instead, which lets the kernel load a split's first
block ids before its seq_len arrives. The heuristic picks `num_splits` from the SM count, the batch and the
table's length bound (no device sync): long single sequences must fill the GPU, large batches need no split.
docs/kernel.md gives the measurements behind the constants and configs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

# one wave of PROGRAMS_PER_SM programs an SM for several sequences; a single sequence fills fewer
# (SINGLE_SEQUENCE_PROGRAMS_PER_SM), since its splits' merge grows with their count; no split below
# MIN_SPLIT_TOKENS, where the merge and per-program start-up cost more than the split gives
PROGRAMS_PER_SM = 2
SINGLE_SEQUENCE_PROGRAMS_PER_SM = 1.7
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 256
INTERPRETER_SMS = 4


@dataclass(frozen=True)
class KernelConfig:
    block_n: int      # tokens per K/V tile (independent of the cache's block_size)
    num_warps: int
    num_stages: int   # depth of Triton's cp.async pipeline over the tiles

    def label(self) -> str:
        return f"{self.block_n}/{self.num_warps}w/{self.num_stages}s"


# the configs that ship, one line of why each (measured on the H200, docs/kernel.md):
# one split (many sequences): 64-token tiles, two stages keep the loads of the next tile in flight
ONE_SPLIT = KernelConfig(64, 4, 2)
# several splits (few long sequences): a third stage, as a split's short loop has no other latency cover
MANY_SPLITS = KernelConfig(64, 4, 3)
# head_dim 256: half the tile, so K and V of two stages fit in shared memory
HEAD_DIM_256 = KernelConfig(32, 4, 2)
# the CPU interpreter: small tiles keep the tests fast
INTERPRETER = KernelConfig(32, 4, 1)


def choose_config(device: torch.device, head_dim_pad: int, elem_size: int = 2,
                  num_splits: int = 1) -> KernelConfig:
    """Tile config from the device, padded head dim, element size and split count only: never from the
    batch, so a fixed num_splits keeps the batch-invariance promise."""
    if device.type != "cuda":
        return INTERPRETER
    if head_dim_pad > 128:
        cfg = HEAD_DIM_256
    else:
        cfg = ONE_SPLIT if num_splits == 1 else MANY_SPLITS
    if elem_size > 2:  # fp32 tiles take twice the shared memory per stage
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
    return cfg


def int32_offsets(block_size: int, num_splits: int) -> bool:
    """Whether the kernel computes cache offsets in int32 (where they fit): at tiny blocks a tile spans 16+
    blocks and address math dominates, and with splits each program's loop is short; with one split and
    blocks of 8+ tokens int64 offsets measured faster."""
    return block_size <= 4 or num_splits > 1


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_size(num_tokens: int, num_splits: int, block_n: int) -> int:
    """Tokens per split: num_tokens cut into num_splits equal pieces rounded up to whole tiles."""
    return _cdiv(_cdiv(num_tokens, num_splits), block_n) * block_n


def choose_num_splits(batch: int, num_kv_heads: int, max_len: int, sms: int, block_n: int = 64) -> int:
    """Split count for the heuristic mode; max_len bounds a sequence's visible tokens. As many splits as fit
    in one wave (rounded down: a partial second wave costs more than it gives); one sequence takes about
    SINGLE_SEQUENCE_PROGRAMS_PER_SM programs an SM; never a split left empty by tile rounding."""
    base = max(1, batch * num_kv_heads)
    wave = PROGRAMS_PER_SM * sms // base
    want = min(round(SINGLE_SEQUENCE_PROGRAMS_PER_SM * sms / base), wave) if batch == 1 else wave
    cap = max(1, max_len // max(MIN_SPLIT_TOKENS, block_n))
    splits = max(1, min(want, cap, MAX_SPLITS))
    return max(1, _cdiv(max_len, split_size(max_len, splits, block_n)))


def decode_num_splits(batch: int, num_kv_heads: int, max_len: int, device) -> int:
    """The heuristic's split count for a decode call on `device` (public: kernels.decode_num_splits)."""
    return choose_num_splits(batch, num_kv_heads, max_len, num_sms(torch.device(device)))


def choose_launch(device: torch.device, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                  elem_size: int, sms: int, num_splits: int | None = None,
                  config: KernelConfig | None = None) -> tuple[KernelConfig, int]:
    """(tile config, split count) of a call: the heuristic's for whichever of the two the caller left None,
    the split count first (the config depends on it). max_len bounds a sequence's visible tokens."""
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_len, sms)
    head_dim_pad = 1 << (head_dim - 1).bit_length()                    # the kernel's padded head_dim
    cfg = config or choose_config(device, head_dim_pad, elem_size, int(num_splits))
    return cfg, int(num_splits)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
