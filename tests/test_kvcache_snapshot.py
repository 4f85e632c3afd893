"""kvcache.snapshot.block_map: exact maps for allocation, prefix hits, forks and eviction; JSON-clean."""

from __future__ import annotations

import json
import random

from kvcache import KVCacheManager
from kvcache.snapshot import block_map, block_owners, from_runs, to_runs


def test_runs_round_trip_and_order():
    assert to_runs([]) == []
    assert to_runs([3, 4, 5, 9, 10, 2]) == [[3, 3], [9, 2], [2, 1]]
    assert to_runs([5, 4]) == [[5, 1], [4, 1]]  # descending ids are not a run: table order is kept
    rng = random.Random(0)
    for _ in range(50):
        ids = rng.sample(range(1, 200), rng.randint(0, 60))
        assert from_runs(to_runs(ids)) == ids


def test_fresh_pool_is_all_free():
    snap = block_map(KVCacheManager(8, 4))
    assert snap == {"num_blocks": 8, "block_size": 4, "free_blocks": 7, "used_blocks": 0, "cached_blocks": 0,
                    "seqs": [], "cached": []}


def test_allocation_prefix_hit_and_owner_labels():
    kv = KVCacheManager(16, 4)
    assert kv.allocate(1, list(range(10))) == [1, 2, 3]  # 4 + 4 + 2 tokens
    kv.mark_computed(1, 10)  # blocks 1, 2 full and registered
    assert kv.allocate(2, list(range(8)) + [99]) == [1, 2, 4]  # prefix hit on 1, 2
    snap = block_map(kv, {1: {"request_id": "cmpl-a", "index": 0}})
    assert snap["seqs"] == [
        {"seq_id": 1, "num_tokens": 10, "num_computed_tokens": 10, "blocks": [[1, 3]],
         "request_id": "cmpl-a", "index": 0},
        {"seq_id": 2, "num_tokens": 9, "num_computed_tokens": 8, "blocks": [[1, 2], [4, 1]]},
    ]
    assert (snap["used_blocks"], snap["free_blocks"], snap["cached_blocks"]) == (4, 11, 0)
    assert block_owners(snap) == {1: [1, 2], 2: [1, 2], 3: [1], 4: [2]}


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(16, 4)
    kv.allocate("p", list(range(6)))  # blocks 1 (full), 2 (2 tokens)
    kv.mark_computed("p", 6)
    assert kv.fork("p", "c") == [(2, 3)]
    owners = block_owners(block_map(kv))
    assert owners == {1: ["p", "c"], 2: ["p"], 3: ["c"]}


def test_free_leaves_cached_blocks_then_eviction_reuses_them():
    kv = KVCacheManager(6, 4)  # 5 usable blocks
    kv.allocate("a", list(range(9)))  # blocks 1, 2 full, 3 partial
    kv.mark_computed("a", 9)
    kv.free("a")
    snap = block_map(kv)
    assert snap["seqs"] == [] and snap["used_blocks"] == 0
    assert snap["cached"] == [[1, 2]] and snap["cached_blocks"] == 2  # the partial block 3 is not cached
    kv.allocate("b", [50 + i for i in range(17)])  # 5 blocks: the free queue's fresh ones, then evicts 1, 2
    snap = block_map(kv)
    assert snap["cached"] == [] and snap["free_blocks"] == 0
    assert sorted(from_runs(snap["seqs"][0]["blocks"])) == [1, 2, 3, 4, 5]


def test_ref_counts_match_the_pool_after_random_traffic():
    rng = random.Random(1)
    kv = KVCacheManager(40, 4)
    live: list[int] = []
    for step in range(300):
        op = rng.random()
        if op < 0.4 or not live:
            prompt = [rng.randint(0, 3) for _ in range(rng.randint(1, 14))]
            if kv.allocate(step, prompt) is not None:
                kv.mark_computed(step, len(prompt) - 1)
                live.append(step)
        elif op < 0.7:
            sid = rng.choice(live)
            if kv.append_slots(sid, 1, [rng.randint(0, 3)]):
                kv.mark_computed(sid, kv.num_tokens(sid) - 1)
        elif op < 0.8:
            if kv.fork(rng.choice(live), step) is not None:
                live.append(step)
        else:
            kv.free(live.pop(rng.randrange(len(live))))
        snap = json.loads(json.dumps(block_map(kv)))  # ints, strings and lists only
        owners = block_owners(snap)
        for b in range(1, kv.num_blocks):
            assert len(owners.get(b, [])) == kv.pool.ref_count(b)
        cached = from_runs(snap["cached"])
        assert sorted(cached) == sorted(kv.pool.cached_block_ids())
        assert not set(cached) & set(owners)
        assert len(owners) == snap["used_blocks"] == kv.usage().used_blocks
