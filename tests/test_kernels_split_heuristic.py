"""The split-count heuristic and the config table (pure functions, no kernel launched)."""

import pytest
import torch

from kernels.split_heuristic import KernelConfig, choose_config, choose_launch, choose_num_splits


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


def test_config_table_by_block_size_splits_and_dtype():
    cuda = torch.device("cuda")
    assert choose_config(cuda, 128, 2, 16, 1) == KernelConfig(64, 4, 2, heads_fastest=True, early_table=True,
                                                              offsets_32=False)
    assert choose_config(cuda, 128, 2, 16, 8).pdl and choose_config(cuda, 128, 2, 16, 8).num_stages == 3
    assert choose_config(cuda, 128, 2, 16, 8).offsets_32                      # int32 offsets with splits
    assert choose_config(cuda, 128, 2, 1, 1).offsets_32                       # and for tiny blocks
    assert choose_config(cuda, 128, 2, 1, 8).table_in_loop
    assert choose_config(cuda, 128, 4, 16, 1).block_n == 32                   # fp32: half the tile
    assert choose_config(torch.device("cpu"), 128) == KernelConfig(32, 4, 1)  # interpreter


@pytest.mark.parametrize("batch,ctx,want", [(1, 32768, 32), (1, 16384, 32), (1, 4096, 16), (2, 32768, 16),
                                            (16, 4096, 2), (64, 2048, 1)])
def test_h200_picks_where_cp_async_loses_the_hint(batch, ctx, want):
    """Register prefetch (what such a toolchain streams few long sequences with) wants one full wave even
    for a single sequence (run 34); several sequences are unchanged."""
    assert choose_num_splits(batch, 8, ctx, 132, cp_async_hint=False) == want


def test_register_prefetch_only_at_many_splits_and_only_without_the_cp_async_hint():
    cuda = torch.device("cuda")
    assert choose_config(cuda, 128, 2, 16, 32, cp_async_hint=False).reg_prefetch
    assert choose_config(cuda, 128, 2, 16, 32, cp_async_hint=False).evict_first
    assert not choose_config(cuda, 128, 2, 16, 32, cp_async_hint=True).reg_prefetch
    assert not choose_config(cuda, 128, 2, 16, 16, cp_async_hint=False).reg_prefetch   # (2, 32768)
    assert not choose_config(cuda, 128, 2, 16, 1, cp_async_hint=False).reg_prefetch
    assert not choose_config(cuda, 128, 2, 1, 32, cp_async_hint=False).reg_prefetch    # tiny blocks
    assert choose_config(cuda, 128, 4, 16, 32, cp_async_hint=False).block_n == 32      # fp32: half the tile


def test_interpreter_keeps_the_hinted_picks():
    from kernels.split_heuristic import cp_async_hint
    assert cp_async_hint(torch.device("cpu"))


def test_choose_launch_takes_the_heuristic_for_what_the_caller_left_open():
    cuda = torch.device("cuda")
    for hint in (True, False):
        cfg, splits = choose_launch(cuda, 1, 8, 32768, 128, 2, 16, 132, hint)
        assert splits == choose_num_splits(1, 8, 32768, 132, cp_async_hint=hint)
        assert cfg == choose_config(cuda, 128, 2, 16, splits, cp_async_hint=hint)
    one_split = choose_launch(cuda, 1, 8, 32768, 80, 2, 16, 132, True, num_splits=1)   # head_dim 80 -> 128
    assert one_split == (choose_config(cuda, 128), 1)
    fixed = KernelConfig(32, 4, 2)
    assert choose_launch(cuda, 64, 8, 8192, 128, 2, 16, 132, True, config=fixed) == (fixed, 1)
