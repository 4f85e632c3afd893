"""Scenario tests for kvcache: exact block ids, ref counts and free-queue order."""

from __future__ import annotations

import pytest
from kvcache_owner import OwnedKV

from kvcache import KVCacheManager, KVCacheUsage


def refs(mgr: KVCacheManager, *block_ids: int) -> list[int]:
    return [mgr.pool.ref_count(b) for b in block_ids]


def queue(mgr: KVCacheManager) -> list[int]:
    return mgr.pool.free_queue_ids()


def snapshot(mgr: KVCacheManager):
    pool = mgr.pool
    seqs = {sid: (mgr.block_table(sid), mgr.num_tokens(sid), mgr.num_cached_tokens(sid),
                  mgr.num_cached_tokens(sid)) for sid in list(mgr._seqs)}
    return ([pool.ref_count(b) for b in range(pool.num_blocks)], queue(mgr),
            [pool.block_hash(b) for b in range(pool.num_blocks)], seqs, mgr.usage())


# ---- construction ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bs", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_block_sizes_accepted(bs):
    mgr = OwnedKV(4, bs)
    assert (mgr.block_size, mgr.num_blocks) == (bs, 4)
    assert queue(mgr) == [1, 2, 3]
    mgr.check_integrity()


@pytest.mark.parametrize("bs", [0, -4, 2.0, True, None])
def test_block_size_rejected(bs):
    with pytest.raises(ValueError):
        OwnedKV(4, bs)


def test_any_positive_block_size_pages():
    """The power-of-two rule is the kernels' (kernels.check_block_size); the paging itself takes any size."""
    mgr = OwnedKV(6, 3)
    assert mgr.allocate("a", list(range(7))) == [1, 2, 3]
    mgr.check_integrity()


def test_num_blocks_rejected():
    with pytest.raises(ValueError):
        OwnedKV(0, 4)


def test_fresh_usage():
    u = OwnedKV(8, 16).usage()
    assert u == KVCacheUsage(num_blocks=8, block_size=16, free_blocks=7, used_blocks=0, cached_blocks=0,
                             prefix_queries=0, prefix_hits=0, prefix_hit_rate=0.0)
    with pytest.raises(AttributeError):
        u.free_blocks = 3  # frozen


# ---- allocate / append -----------------------------------------------------------------------------
def test_allocate_append_across_block_boundary():
    mgr = OwnedKV(8, 4)
    assert mgr.can_allocate(3)
    assert mgr.allocate("a", [1, 2, 3]) == [1]
    assert mgr.num_tokens("a") == 3 and mgr.num_cached_tokens("a") == 0
    assert refs(mgr, 1) == [1] and queue(mgr) == [2, 3, 4, 5, 6, 7]
    assert mgr.append_slots("a", 1, [4])  # fills block 1, no new block
    assert mgr.block_table("a") == [1] and queue(mgr) == [2, 3, 4, 5, 6, 7]
    assert mgr.append_slots("a", 1, [5])  # crosses the boundary: one new block
    assert mgr.block_table("a") == [1, 2] and queue(mgr) == [3, 4, 5, 6, 7]
    assert mgr.append_slots("a", 6)  # 11 tokens: 3 blocks, ids unknown
    assert mgr.block_table("a") == [1, 2, 3] and mgr.num_tokens("a") == 11
    assert mgr.append_slots("a", 0)
    assert mgr.slot_mapping("a", 0, 11) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert mgr.slot_mapping("a", 10, 11) == [14]
    assert mgr.slot_mapping("a", 5, 5) == []
    u = mgr.usage()
    assert (u.free_blocks, u.used_blocks, u.cached_blocks) == (4, 3, 0)
    mgr.check_integrity()


def test_slot_mapping_non_contiguous_and_bounds():
    mgr = OwnedKV(8, 2)
    mgr.allocate("a", [1, 2])  # [1]
    mgr.allocate("b", [1, 2, 3])  # [2, 3]
    assert mgr.append_slots("a", 1)  # -> [1, 4]
    assert mgr.block_table("a") == [1, 4]
    assert mgr.slot_mapping("a", 0, 3) == [2, 3, 8]
    assert mgr.slot_mapping("b", 1, 3) == [5, 6]
    for bad in [(-1, 1), (2, 1), (0, 4)]:
        with pytest.raises(ValueError):
            mgr.slot_mapping("a", *bad)


def test_block_table_is_a_copy_and_table_view_is_live():
    mgr = OwnedKV(8, 2)
    mgr.allocate("a", [1, 2, 3])  # [1, 2]
    table, live = mgr.block_table("a"), mgr.table_view("a")
    table.append(7)  # the caller's copy
    assert mgr.block_table("a") == [1, 2]
    assert mgr.append_slots("a", 2) and list(live) == [1, 2, 3]  # the runner syncs its device copy from it


def test_free_in_reverse_order():
    mgr = OwnedKV(8, 4)
    assert mgr.allocate("a", list(range(9))) == [1, 2, 3]
    assert mgr.allocate("b", list(range(4))) == [4]
    assert queue(mgr) == [5, 6, 7]
    mgr.free("a")  # tail first: block 3 is evicted before block 1
    assert queue(mgr) == [5, 6, 7, 3, 2, 1]
    assert refs(mgr, 1, 2, 3, 4) == [0, 0, 0, 1]
    assert not mgr.has_seq("a") and mgr.has_seq("b")
    mgr.free("b")
    assert queue(mgr) == [5, 6, 7, 3, 2, 1, 4]
    assert mgr.allocate("c", list(range(100, 109))) == [5, 6, 7]  # front of the queue first
    assert queue(mgr) == [3, 2, 1, 4]
    mgr.check_integrity()


def test_can_allocate_counts_free_and_cached():
    mgr = OwnedKV(4, 2)  # 3 usable
    assert mgr.can_allocate(6) and not mgr.can_allocate(7)
    mgr.allocate("a", [1, 2, 3, 4])
    mgr.mark_computed("a", 4)
    mgr.free("a")  # 2 cached + 1 free
    assert mgr.usage().cached_blocks == 2
    assert mgr.can_allocate(6)
    assert mgr.allocate("b", [7, 7, 7, 7, 7, 7]) == [3, 2, 1]  # evicts both cached blocks
    assert mgr.usage().cached_blocks == 0
    assert mgr.pool.block_hash(1) is None and mgr.pool.block_hash(2) is None


# ---- prefix cache ----------------------------------------------------------------------------------
def test_prefix_hit_miss_partial_hit():
    mgr = OwnedKV(10, 4)
    prompt = list(range(10))  # blocks (0..3) (4..7) and a partial (8, 9)
    assert mgr.allocate("a", prompt) == [1, 2, 3]
    mgr.mark_computed("a", 10)
    assert mgr.pool.block_hash(1) is not None and mgr.pool.block_hash(2) is not None
    assert mgr.pool.block_hash(3) is None  # partial: never hashed
    mgr.free("a")
    assert queue(mgr) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert mgr.usage().cached_blocks == 2

    # full hit: both full blocks come back (ref 0 -> 1), leaving the free queue
    assert mgr.allocate("b", prompt) == [1, 2, 4]
    assert mgr.num_cached_tokens("b") == 8
    assert mgr.num_cached_tokens("b") == 8
    assert refs(mgr, 1, 2, 4) == [1, 1, 1]
    assert queue(mgr) == [5, 6, 7, 8, 9, 3]
    assert mgr.usage().cached_blocks == 0

    # partial hit: first block only, shared with b
    assert mgr.allocate("c", [0, 1, 2, 3, 99, 99, 99, 99, 7]) == [1, 5, 6]
    assert mgr.num_cached_tokens("c") == 4
    assert refs(mgr, 1, 2) == [2, 1]

    # miss
    assert mgr.allocate("d", [9, 9, 9, 9, 9]) == [7, 8]
    assert mgr.num_cached_tokens("d") == 0

    # a prompt that is exactly the cached blocks: the last hit block is dropped (>= 1 token to compute)
    assert mgr.allocate("e", list(range(8))) == [1, 9]
    assert mgr.num_cached_tokens("e") == 4
    assert refs(mgr, 1) == [3]

    u = mgr.usage()
    assert (u.prefix_queries, u.prefix_hits) == (10 + 10 + 9 + 5 + 8, 0 + 8 + 4 + 0 + 4)
    assert u.prefix_hit_rate == pytest.approx(16 / 42)
    assert (u.free_blocks, u.used_blocks, u.cached_blocks) == (1, 8, 0)
    mgr.check_integrity()


def test_prefix_needs_mark_computed():
    mgr = OwnedKV(10, 4)
    mgr.allocate("a", list(range(9)))
    assert mgr.allocate("b", list(range(9))) == [4, 5, 6]  # a's K/V not written yet: no hit
    mgr.mark_computed("a", 5)  # only block 1 is fully computed
    assert mgr.pool.block_hash(1) is not None and mgr.pool.block_hash(2) is None
    assert mgr.allocate("c", list(range(9))) == [1, 7, 8]
    assert mgr.num_cached_tokens("c") == 4
    mgr.mark_computed("a", 9)
    assert mgr.pool.block_hash(2) is not None
    mgr.check_integrity()


def test_decode_tokens_get_hashed():
    mgr = OwnedKV(10, 2)
    mgr.allocate("a", [1, 2, 3])  # [1, 2]
    mgr.mark_computed("a", 3)
    assert mgr.append_slots("a", 1, [4])  # the sampled token, K/V written next step
    mgr.mark_computed("a", 4)
    assert mgr.pool.block_hash(2) is not None
    mgr.free("a")
    assert mgr.allocate("b", [1, 2, 3, 4, 5]) == [1, 2, 3]
    assert mgr.num_cached_tokens("b") == 4


def test_unknown_token_ids_stop_hashing():
    mgr = OwnedKV(10, 2)
    mgr.allocate("a", [1, 2])  # [1]
    assert mgr.append_slots("a", 2)  # ids unknown -> [1, 2]
    assert mgr.append_slots("a", 2, [5, 6])  # [1, 2, 3]
    mgr.mark_computed("a", 6)
    assert [mgr.pool.block_hash(b) is not None for b in (1, 2, 3)] == [True, False, False]


def test_eviction_order_lru_tail_first():
    mgr = OwnedKV(6, 2)  # usable 1..5
    assert mgr.allocate("a", [1, 2, 3, 4]) == [1, 2]
    mgr.mark_computed("a", 4)
    assert mgr.allocate("b", [5, 6, 7, 8]) == [3, 4]
    mgr.mark_computed("b", 4)
    mgr.free("a")
    mgr.free("b")
    assert queue(mgr) == [5, 2, 1, 4, 3]
    assert mgr.pool.cached_block_ids() == [2, 1, 4, 3]
    # a fresh 3-block sequence: the never-hashed 5, then a's tail, then a's head (freed before b's)
    assert mgr.allocate("c", [9] * 6) == [5, 2, 1]
    assert mgr.pool.block_hash(1) is None and mgr.pool.block_hash(2) is None
    assert queue(mgr) == [4, 3]
    # b's prefix is cached (2 blocks, both revived) but the third block has nowhere to come from
    before = snapshot(mgr)
    assert mgr.allocate("d", [5, 6, 7, 8, 0]) is None
    assert snapshot(mgr) == before
    mgr.free("c")
    assert queue(mgr) == [4, 3, 1, 2, 5]
    assert mgr.allocate("d", [5, 6, 7, 8, 0]) == [3, 4, 1]
    assert queue(mgr) == [2, 5]
    # a's prompt was evicted: a miss now
    assert mgr.allocate("e", [1, 2, 3]) == [2, 5]
    assert mgr.num_cached_tokens("e") == 0
    mgr.check_integrity()


def test_cached_block_revived_from_middle_of_queue():
    mgr = OwnedKV(8, 2)
    mgr.allocate("a", [1, 2, 3])  # [1, 2]
    mgr.mark_computed("a", 3)
    mgr.free("a")
    assert queue(mgr) == [3, 4, 5, 6, 7, 2, 1]
    assert mgr.allocate("b", [1, 2, 9]) == [1, 3]
    assert queue(mgr) == [4, 5, 6, 7, 2]
    mgr.free("b")  # the revived block goes to the back again
    assert queue(mgr) == [4, 5, 6, 7, 2, 3, 1]


def test_prefix_caching_off():
    mgr = OwnedKV(8, 2, enable_prefix_caching=False)
    assert not mgr.enable_prefix_caching
    assert mgr.allocate("a", [1, 2, 3, 4, 5]) == [1, 2, 3]
    mgr.mark_computed("a", 5)
    assert all(mgr.pool.block_hash(b) is None for b in range(8))
    mgr.free("a")
    assert queue(mgr) == [4, 5, 6, 7, 3, 2, 1]
    assert mgr.allocate("b", [1, 2, 3, 4, 5]) == [4, 5, 6]
    assert mgr.num_cached_tokens("b") == 0
    u = mgr.usage()
    assert (u.cached_blocks, u.prefix_queries, u.prefix_hits, u.prefix_hit_rate) == (0, 0, 0, 0.0)
    mgr.check_integrity()


# ---- fork / copy-on-write --------------------------------------------------------------------------
def test_fork_copies_partial_last_block():
    mgr = OwnedKV(10, 4)
    assert mgr.allocate("a", list(range(6))) == [1, 2]
    mgr.mark_computed("a", 6)
    assert mgr.fork("a", "b") == [(2, 3)]
    assert mgr.block_table("b") == [1, 3]
    assert refs(mgr, 1, 2, 3) == [2, 1, 1]
    assert mgr.num_tokens("b") == 6
    assert queue(mgr) == [4, 5, 6, 7, 8, 9]
    # each appends into its own partial block
    assert mgr.append_slots("a", 1, [60]) and mgr.append_slots("b", 1, [61])
    assert mgr.slot_mapping("a", 6, 7) == [2 * 4 + 2] and mgr.slot_mapping("b", 6, 7) == [3 * 4 + 2]
    # a fork of a fork
    assert mgr.fork("b", "c") == [(3, 4)]
    assert refs(mgr, 1, 3, 4) == [3, 1, 1]
    mgr.free("b")
    assert refs(mgr, 1, 3) == [2, 0] and queue(mgr) == [5, 6, 7, 8, 9, 3]
    mgr.check_integrity()


def test_fork_full_last_block_shares_everything():
    mgr = OwnedKV(10, 4)
    assert mgr.allocate("a", list(range(8))) == [1, 2]
    assert mgr.fork("a", "b") == []
    assert mgr.block_table("b") == [1, 2] and refs(mgr, 1, 2) == [2, 2]
    assert mgr.append_slots("b", 1, [8])  # the next write goes into a fresh block
    assert mgr.block_table("b") == [1, 2, 3]
    assert mgr.append_slots("a", 1, [9])
    assert mgr.block_table("a") == [1, 2, 4]
    mgr.free("a")
    assert refs(mgr, 1, 2, 4) == [1, 1, 0] and queue(mgr)[-1] == 4
    mgr.check_integrity()


def test_fork_block_size_1():
    mgr = OwnedKV(6, 1)
    mgr.allocate("a", [5, 6])
    assert mgr.fork("a", "b") == []  # with block_size 1 every block is full
    assert refs(mgr, 1, 2) == [2, 2]


# ---- block sizes 1 and 256 -------------------------------------------------------------------------
def test_block_size_1():
    mgr = OwnedKV(6, 1)
    assert mgr.allocate("a", [7, 8, 9]) == [1, 2, 3]
    assert mgr.slot_mapping("a", 0, 3) == [1, 2, 3]
    mgr.mark_computed("a", 3)
    assert all(mgr.pool.block_hash(b) is not None for b in (1, 2, 3))
    mgr.free("a")
    assert queue(mgr) == [4, 5, 3, 2, 1]
    assert mgr.allocate("b", [7, 8, 9]) == [1, 2, 4]  # the last token's block is never a hit
    assert mgr.num_cached_tokens("b") == 2
    assert mgr.append_slots("b", 1, [10])
    assert mgr.block_table("b") == [1, 2, 4, 5]
    assert not mgr.append_slots("b", 2)  # only block 3 left
    assert mgr.append_slots("b", 1)
    assert mgr.block_table("b") == [1, 2, 4, 5, 3] and queue(mgr) == []
    mgr.check_integrity()


def test_block_size_256():
    mgr = OwnedKV(4, 256)
    prompt = list(range(300))
    assert mgr.allocate("a", prompt) == [1, 2]
    assert mgr.slot_mapping("a", 254, 258) == [510, 511, 512, 513]
    mgr.mark_computed("a", 300)
    assert mgr.pool.block_hash(1) is not None and mgr.pool.block_hash(2) is None
    assert mgr.allocate("b", prompt + [1]) == [1, 3]
    assert mgr.num_cached_tokens("b") == 256
    assert refs(mgr, 1) == [2]
    assert mgr.append_slots("a", 212)  # exactly fills block 2
    assert not mgr.append_slots("a", 1)
    assert not mgr.can_allocate(1)
    assert mgr.allocate("c", list(range(256))) is None  # hit dropped (last token's block), none free
    mgr.check_integrity()


# ---- out of blocks leaves state unchanged ----------------------------------------------------------
def test_out_of_blocks_returns_leave_state_unchanged():
    mgr = OwnedKV(5, 2)  # usable 1..4
    mgr.allocate("a", [1, 2, 3])  # [1, 2]
    mgr.mark_computed("a", 3)
    mgr.allocate("b", [4, 5, 6])  # [3, 4]
    before = snapshot(mgr)
    assert not mgr.can_allocate(1)
    assert mgr.allocate("c", [1, 2, 7]) is None  # would hit block 1 but needs one more block
    assert not mgr.has_seq("c")
    assert mgr.append_slots("a", 2) is False
    assert mgr.fork("a", "d") is None  # partial last block needs a copy
    assert not mgr.has_seq("d")
    assert snapshot(mgr) == before
    assert mgr.fork("b", "e") is None
    assert mgr.append_slots("b", 1) is True  # still fits in block 4
    mgr.check_integrity()


def test_allocate_hit_only_out_of_blocks_does_not_revive():
    mgr = OwnedKV(3, 2)  # usable 1, 2
    mgr.allocate("a", [1, 2, 3])
    mgr.mark_computed("a", 3)
    mgr.free("a")  # [2, 1], block 1 cached
    mgr.allocate("x", [9])  # takes 2 -> queue [1]
    before = snapshot(mgr)
    assert mgr.allocate("b", [1, 2, 3]) is None  # hit on 1 would leave nothing for the second block
    assert snapshot(mgr) == before
    assert mgr.pool.free_queue_ids() == [1]


# ---- programming errors ----------------------------------------------------------------------------
def test_misuse_raises():
    mgr = OwnedKV(8, 4)
    mgr.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError):
        mgr.allocate("a", [1])
    with pytest.raises(ValueError):
        mgr.allocate("z", [])
    for call in (lambda: mgr.free("nope"), lambda: mgr.append_slots("nope", 1),
                 lambda: mgr.block_table("nope"), lambda: mgr.fork("nope", "x"),
                 lambda: mgr.mark_computed("nope", 0), lambda: mgr.num_tokens("nope")):
        with pytest.raises(KeyError):
            call()
    with pytest.raises(ValueError):
        mgr.fork("a", "a")
    with pytest.raises(ValueError):
        mgr.append_slots("a", 2, [1])
    with pytest.raises(ValueError):
        mgr.append_slots("a", -1)
    with pytest.raises(ValueError):
        mgr.mark_computed("a", 4)
    mgr.free("a")
    with pytest.raises(KeyError):
        mgr.free("a")
    mgr.check_integrity()


def test_kvcache_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, kvcache; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ensure_slots_grows_to_the_owners_count_only():
    mgr = KVCacheManager(4, 2)  # usable 1..3
    mgr.allocate("a", [1, 2, 3])  # [1, 2]
    assert mgr.ensure_slots("a", 3) and mgr.block_table("a") == [1, 2]  # holds them already
    assert mgr.ensure_slots("a", 4) and mgr.block_table("a") == [1, 2] and mgr.num_tokens("a") == 4  # room
    assert mgr.ensure_slots("a", 5) and mgr.block_table("a") == [1, 2, 3] and mgr.num_tokens("a") == 5
    assert not mgr.ensure_slots("a", 7) and mgr.num_tokens("a") == 5  # out of blocks: unchanged
    assert mgr.ensure_slots("a", 2) and mgr.num_tokens("a") == 5  # never shrinks


def test_keep_free_counts_only_the_blocks_an_allocation_takes():
    """A prompt sharing a running sequence's full blocks takes only its tail: `keep_free` (the scheduler's
    room for decodes) is weighed against those, not against the whole prompt."""
    mgr = OwnedKV(9, 2)  # 8 usable blocks of 2
    shared = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 5 blocks
    mgr.allocate("a", shared + [11])  # 6 blocks
    mgr.mark_computed("a", 11)
    assert mgr.usage().free_blocks == 2
    before = mgr.usage()
    assert mgr.allocate("x", [20, 21, 22, 23, 24]) is None  # 3 new blocks: no room at all
    assert mgr.usage() == before
    assert mgr.allocate("b", shared + [12], keep_free=2) is None  # 1 new block would leave 1 < 2
    assert mgr.allocate("b", shared + [12], keep_free=1) is not None  # the 5 shared blocks cost nothing
    assert mgr.num_cached_tokens("b") == 10 and mgr.usage().free_blocks == 1
    mgr.check_integrity()


@pytest.mark.parametrize("corrupt,message", [
    (lambda m: m._seqs["a"].block_table.__setitem__(0, 99), "a block id outside the pool"),  # was IndexError
    (lambda m: setattr(m._seqs["a"], "num_cached_tokens", 3), "a prefix hit of part of a block"),
])
def test_integrity_names_a_corrupted_table(corrupt, message):
    mgr = OwnedKV(6, 2)
    mgr.allocate("a", [1, 2, 3, 4, 5])
    mgr.check_integrity()
    corrupt(mgr)
    with pytest.raises(AssertionError, match=message):
        mgr.check_integrity()
