"""Forced hash collisions never share blocks; check_integrity() really fails on corrupted state."""

from __future__ import annotations

import pytest
from kvcache_owner import OwnedKV

from kvcache import BlockPool, KVCacheManager, default_block_hash, prefix_hash


def const_hash(parent, tokens):
    return 0


# ---- hashing ---------------------------------------------------------------------------------------
def test_default_hash_is_chained():
    h0 = default_block_hash(None, (1, 2))
    assert h0 == default_block_hash(None, (1, 2))
    assert default_block_hash(h0, (3, 4)) != default_block_hash(default_block_hash(None, (9, 9)), (3, 4))
    assert OwnedKV(4, 2).pool.hash_fn is prefix_hash.default_block_hash


def test_forced_collision_does_not_share():
    mgr = OwnedKV(10, 4, hash_fn=const_hash)
    assert mgr.allocate("a", [1, 2, 3, 4, 5]) == [1, 2]
    mgr.mark_computed("a", 5)
    assert mgr.pool.block_hash(1) == 0
    # a different block forced onto the same hash: looked up, rejected on token ids
    assert mgr.allocate("b", [9, 9, 9, 9, 5]) == [3, 4]
    assert mgr.num_cached_tokens("b") == 0
    assert mgr.pool.ref_count(1) == 1
    mgr.mark_computed("b", 5)
    assert mgr.pool.block_hash(3) == 0  # both live in the one bucket
    # the genuine prefix still hits the right block in the shared bucket
    assert mgr.allocate("c", [9, 9, 9, 9, 7]) == [3, 5]
    assert mgr.allocate("d", [1, 2, 3, 4, 7]) == [1, 6]
    mgr.check_integrity()


def test_forced_collision_same_tokens_different_parent():
    mgr = OwnedKV(10, 2, hash_fn=const_hash)
    mgr.allocate("a", [1, 1, 2, 2, 0])  # blocks (1,1) (2,2)
    mgr.mark_computed("a", 5)
    mgr.allocate("b", [3, 3, 2, 2, 0])  # same second block, different parent
    mgr.mark_computed("b", 5)
    assert mgr.block_table("b") == [4, 5, 6]
    mgr.free("a")
    mgr.free("b")
    assert mgr.allocate("c", [3, 3, 2, 2, 9]) == [4, 5, 7]
    assert mgr.allocate("d", [1, 1, 2, 2, 9]) == [1, 2, 8]
    mgr.check_integrity()


def test_stale_parent_id_is_not_trusted():
    """A child block chains on its parent's content tag, not its id: reuse of the parent id is no hit."""
    pool = BlockPool(4, hash_fn=const_hash)
    assert pool.take_new(2) == [1, 2]
    pool.register(1, None, (1, 1))
    pool.register(2, 1, (2, 2))
    pool.release([1, 2])  # head freed first (only possible at pool level)
    assert pool.free_queue_ids() == [3, 1, 2]
    assert pool.take_new(2) == [3, 1]  # evicts block 1 (1,1), block 2 (2,2) stays cached
    pool.register(1, None, (3, 3))
    assert pool.lookup(0, None, (3, 3)) == 1
    assert pool.lookup(0, pool.block_tag(1), (2, 2)) is None  # block 2's K/V follow (1,1), not (3,3)
    pool.check_integrity()


def test_equal_content_registered_twice_shares_a_tag():
    mgr = OwnedKV(8, 2)
    mgr.allocate("a", [1, 2, 3])
    mgr.allocate("b", [1, 2, 3])  # concurrent: no hit, its own blocks
    mgr.mark_computed("a", 3)
    mgr.mark_computed("b", 3)
    assert mgr.block_table("a") == [1, 2] and mgr.block_table("b") == [3, 4]
    assert mgr.pool.block_tag(1) == mgr.pool.block_tag(3)
    mgr.free("a")
    assert mgr.pool.free_queue_ids() == [5, 6, 7, 2, 1]
    assert mgr.allocate("x", [7] * 10) == [5, 6, 7, 2, 1]  # evicts a's copy
    assert mgr.pool.block_hash(1) is None
    mgr.free("x")
    assert mgr.allocate("c", [1, 2, 5]) == [3, 1]  # b's copy serves the prefix
    assert mgr.num_cached_tokens("c") == 2
    mgr.check_integrity()


# ---- check_integrity can fail ----------------------------------------------------------------------
def busy_manager() -> KVCacheManager:
    mgr = OwnedKV(10, 4)
    mgr.allocate("a", list(range(6)))  # [1, 2]
    mgr.mark_computed("a", 6)
    mgr.fork("a", "b")  # [1, 3]
    mgr.allocate("c", [7, 7, 7])  # [4]
    mgr.free("c")
    mgr.check_integrity()
    return mgr


def test_integrity_catches_wrong_ref_count():
    mgr = busy_manager()
    mgr.pool._blocks[1].ref_count = 1
    with pytest.raises(AssertionError, match="block 1: ref count 1 != 2 tables"):
        mgr.check_integrity()


def test_integrity_catches_free_queue_mismatch():
    mgr = busy_manager()
    del mgr.pool._free[4]
    with pytest.raises(AssertionError, match="in free queue"):
        mgr.check_integrity()


def test_integrity_catches_used_block_in_free_queue():
    mgr = busy_manager()
    mgr.pool._free[2] = None
    with pytest.raises(AssertionError, match="block 2: ref count 1 but in free queue = True"):
        mgr.check_integrity()


def test_integrity_catches_null_block_handed_out():
    mgr = busy_manager()
    mgr._seqs["a"].block_table[1] = 0
    with pytest.raises(AssertionError, match="null block"):
        mgr.check_integrity()


def test_integrity_catches_shared_partial_block():
    mgr = busy_manager()
    seq_b = mgr._seqs["b"]
    mgr.pool.release([seq_b.block_table[-1]])
    seq_b.block_table[-1] = 2  # b now writes into a's partial block
    mgr.pool.touch([2])
    with pytest.raises(AssertionError, match="partial block 2 .* is shared"):
        mgr.check_integrity()


def test_integrity_catches_table_size():
    mgr = busy_manager()
    mgr._seqs["a"].num_tokens += 3  # 9 tokens in 2 blocks
    with pytest.raises(AssertionError, match="2 blocks for 9 tokens"):
        mgr.check_integrity()


def test_mark_computed_hashes_the_owners_ids_once_known():
    """A slot is appended before its token is sampled; the owner passes the ids when the K/V are written."""
    mgr = KVCacheManager(10, 2)
    ids = [1, 2, 3]
    assert mgr.allocate("a", ids) == [1, 2]
    assert mgr.append_slots("a", 1)  # the token being sampled: id unknown to everyone yet
    with pytest.raises(ValueError, match="outside"):
        mgr.mark_computed("a", 4, ids)  # the owner does not know token 3 either
    mgr.mark_computed("a", 3, ids)
    assert [mgr.pool.block_hash(b) is not None for b in (1, 2)] == [True, False]
    ids.append(7)
    mgr.mark_computed("a", 4, ids)
    assert mgr.pool.block_token_ids(2) == (3, 7)
    assert mgr.allocate("b", [1, 2, 3, 7, 8]) == [1, 2, 3]  # both full blocks hit
    mgr.check_integrity()


@pytest.mark.parametrize("hash_fn", [default_block_hash, const_hash])
def test_precomputed_prefix_keys_find_what_hashing_finds(hash_fn):
    """allocate with a prompt's prefix_keys (all of them, a leading part, none) gives the hits that hashing
    the ids there gives, for prompts that share 0-5 blocks with cached ones and run longer than the keys
    (a preempted sequence's prompt + generated ids); colliding hashes too."""
    import random
    rng = random.Random(0)
    base = [rng.randrange(50) for _ in range(40)]
    kept = KVCacheManager(200, 4, hash_fn=hash_fn)
    kept.allocate("seed", base)
    kept.mark_computed("seed", len(base), base)
    for trial in range(30):
        shared = 4 * rng.randrange(6)
        prompt = base[:shared] + [rng.randrange(50) for _ in range(rng.randrange(1, 15))]
        ids = prompt + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        keys = kept.prefix_keys(prompt)
        assert len(keys) == (len(prompt) - 1) // 4 and all(tokens == tuple(prompt[4 * i:4 * i + 4])
                                                           for i, (_, tokens) in enumerate(keys))
        want = kept.pool.cached_prefix(ids, 4, (len(ids) - 1) // 4)
        for given in (keys, keys[:len(keys) // 2], []):
            assert kept.pool.cached_prefix(ids, 4, (len(ids) - 1) // 4, given) == want, (trial, len(given))
        assert kept.allocate(f"t{trial}", ids, keys)[:len(want)] == want
        assert kept.num_cached_tokens(f"t{trial}") == 4 * len(want)
        kept.free(f"t{trial}")
    kept.check_integrity()
    assert KVCacheManager(10, 4, enable_prefix_caching=False).prefix_keys(base) == []


def test_integrity_catches_stale_hash_map():
    mgr = busy_manager()
    mgr.pool._blocks[1].clear_hash()
    with pytest.raises(AssertionError, match="hash map entries != hashed blocks"):
        mgr.check_integrity()


def test_integrity_catches_cached_counter():
    mgr = busy_manager()
    mgr.pool._num_cached += 1
    with pytest.raises(AssertionError, match="cached-block counter"):
        mgr.check_integrity()


def test_default_hash_is_the_same_in_every_process():
    """The first block's parent is a constant, not None (hash(None) is its address before Python 3.12):
    keys computed in one process match another's."""
    import subprocess
    import sys

    code = "from kvcache import default_block_hash as h; print(h(h(None, (1, 2, 3)), (4, 5, 6)))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout for seed in (1, 2, 3)}
    here = default_block_hash(default_block_hash(None, (1, 2, 3)), (4, 5, 6))
    assert len(runs) == 1 and runs.pop().strip() == str(here)
