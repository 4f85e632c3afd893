"""The split-count heuristic and the config table (pure functions, no kernel launched)."""

import pytest
import torch

from kernels.split_heuristic import (
    KernelConfig,
    choose_config,
    choose_launch,
    choose_num_splits,
    int32_offsets,
    split_size,
)


@pytest.mark.parametrize("batch,ctx,want", [(1, 4096, 16), (1, 32768, 27), (1, 16384, 26), (2, 32768, 16),
                                            (4, 16384, 8), (16, 4096, 2), (64, 2048, 1), (256, 1024, 1),
                                            (1, 100, 1), (1, 1, 1)])
def test_h200_picks(batch, ctx, want):
    """The split counts measured best on the H200 (132 SMs, Hkv 8) for the benchmark shapes."""
    assert choose_num_splits(batch, 8, ctx, 132) == want


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 17, 40])
@pytest.mark.parametrize("ctx", [1, 63, 64, 65, 1000, 5000, 32768, 131072])
def test_no_split_is_empty_and_one_wave_at_most(batch, ctx):
    splits = choose_num_splits(batch, 8, ctx, 132)
    per = -(-ctx // splits)
    per = -(-per // 64) * 64                                    # the kernel's tile-rounded split size
    assert 1 <= splits <= 256 and (splits - 1) * per < ctx     # the last split holds at least one token
    assert splits == 1 or batch * 8 * splits <= 2 * 132


def test_config_table_by_splits_head_dim_and_dtype():
    cuda = torch.device("cuda")
    assert choose_config(cuda, 128, 2, 1) == KernelConfig(64, 4, 2)
    assert choose_config(cuda, 128, 2, 8) == KernelConfig(64, 4, 3)               # a deeper pipeline
    assert choose_config(cuda, 256, 2, 1) == KernelConfig(32, 4, 2)               # head_dim 256
    assert choose_config(cuda, 128, 4, 1).block_n == 32                           # fp32: half the tile
    assert choose_config(torch.device("cpu"), 128) == KernelConfig(32, 4, 1)      # interpreter


def test_int32_offsets_for_tiny_blocks_and_splits_only():
    assert int32_offsets(1, 1) and int32_offsets(4, 1) and int32_offsets(16, 8)
    assert not int32_offsets(16, 1) and not int32_offsets(128, 1)


@pytest.mark.parametrize("tokens,splits,block_n", [(1, 1, 64), (4096, 16, 64), (32768, 27, 64), (100, 3, 32)])
def test_split_size_covers_the_range_in_whole_tiles(tokens, splits, block_n):
    per = split_size(tokens, splits, block_n)
    assert per % block_n == 0 and per * splits >= tokens and (per - block_n) * splits < tokens


def test_choose_launch_takes_the_heuristic_for_what_the_caller_left_open():
    cuda = torch.device("cuda")
    cfg, splits = choose_launch(cuda, 1, 8, 32768, 128, 2, 132)
    assert splits == choose_num_splits(1, 8, 32768, 132)
    assert cfg == choose_config(cuda, 128, 2, splits)
    one_split = choose_launch(cuda, 1, 8, 32768, 80, 2, 132, num_splits=1)       # head_dim 80 -> 128
    assert one_split == (choose_config(cuda, 128), 1)
    fixed = KernelConfig(32, 4, 2)
    assert choose_launch(cuda, 64, 8, 8192, 128, 2, 132, config=fixed) == (fixed, 1)


def test_public_decode_num_splits_is_the_heuristic():
    import kernels
    cpu = torch.device("cpu")
    assert kernels.decode_num_splits(1, 8, 131072, cpu) == choose_num_splits(1, 8, 131072, 4)
    assert kernels.decode_num_splits(64, 8, 2048, cpu) == 1
