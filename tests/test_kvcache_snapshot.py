"""kvcache.snapshot: exact maps for allocation, prefix hits, forks and eviction; the per-block view agrees
with the pool after random traffic; runs keep a large map small; JSON-clean."""

from __future__ import annotations

import json
import random

from kvcache_owner import OwnedKV

from kvcache.snapshot import block_map, from_runs, per_block, to_runs


def summary(snap: dict) -> list[tuple]:
    return [(b["id"], b["state"], b["ref_count"], b["tokens"], [o["seq_id"] for o in b["owners"]])
            for b in per_block(snap)]


def test_runs_round_trip_in_table_order():
    assert to_runs([]) == []
    assert to_runs([3, 4, 5, 9, 10, 2]) == [[3, 3], [9, 2], [2, 1]]
    assert to_runs([5, 4]) == [[5, 1], [4, 1]]  # descending ids are not a run: table order is kept
    rng = random.Random(0)
    for _ in range(50):
        ids = rng.sample(range(1, 200), rng.randint(0, 60))
        assert from_runs(to_runs(ids)) == ids


def test_fresh_pool_is_all_free():
    assert block_map(OwnedKV(8, 4)) == {"block_size": 4, "num_blocks": 8, "free_blocks": 7,
                                               "used_blocks": 0, "cached_blocks": 0, "seqs": [], "cached": []}


def test_allocation_prefix_hit_and_owner_labels():
    kv = OwnedKV(16, 4)
    assert kv.allocate(1, list(range(10))) == [1, 2, 3]  # 4 + 4 + 2 tokens
    kv.mark_computed(1, 10)  # blocks 1, 2 full and registered
    assert kv.allocate(2, list(range(8)) + [99]) == [1, 2, 4]  # prefix hit on 1, 2
    snap = block_map(kv, {1: {"request_id": "cmpl-a", "index": 0}})
    assert snap["seqs"] == [
        {"seq_id": 1, "request_id": "cmpl-a", "index": 0, "num_tokens": 10, "blocks": [[1, 3]]},
        {"seq_id": 2, "num_tokens": 9, "blocks": [[1, 2], [4, 1]]},
    ]
    assert (snap["used_blocks"], snap["free_blocks"], snap["cached_blocks"]) == (4, 11, 0)
    assert summary(snap) == [(1, "used", 2, 4, [1, 2]), (2, "used", 2, 4, [1, 2]), (3, "used", 1, 2, [1]),
                             (4, "used", 1, 1, [2])]
    assert per_block(snap)[2]["owners"] == [{"seq_id": 1, "request_id": "cmpl-a", "index": 0,
                                             "num_tokens": 10}]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = OwnedKV(16, 4)
    kv.allocate("p", list(range(6)))  # blocks 1 (full), 2 (2 tokens)
    kv.mark_computed("p", 6)
    assert kv.fork("p", "c") == [(2, 3)]
    assert summary(block_map(kv)) == [(1, "used", 2, 4, ["p", "c"]), (2, "used", 1, 2, ["p"]),
                                      (3, "used", 1, 2, ["c"])]


def test_free_leaves_cached_blocks_then_eviction_reuses_them():
    kv = OwnedKV(6, 4)  # 5 usable blocks
    kv.allocate("a", list(range(9)))  # blocks 1, 2 full, 3 partial
    kv.mark_computed("a", 9)
    kv.free("a")
    snap = block_map(kv)
    assert snap["seqs"] == [] and snap["cached"] == [[1, 2]]  # the partial block 3 is free, not cached
    assert summary(snap) == [(1, "cached", 0, 4, []), (2, "cached", 0, 4, [])]
    assert (snap["used_blocks"], snap["free_blocks"], snap["cached_blocks"]) == (0, 5, 2)
    kv.allocate("b", [50 + i for i in range(17)])  # 5 blocks: the fresh ones first, then evicts 1, 2
    snap = block_map(kv)
    assert snap["cached"] == [] and snap["seqs"][0]["blocks"] == [[4, 2], [3, 1], [2, 1], [1, 1]]
    assert [b["tokens"] for b in per_block(snap)] == [1, 4, 4, 4, 4]  # block 1 is the table's last


def test_a_large_cache_maps_to_a_few_runs():
    kv = OwnedKV(100_001, 16)
    for s in range(4):
        kv.allocate(s, [s] * 16 * 20_000)  # 20K blocks each, handed out in id order
        kv.mark_computed(s, 16 * 20_000 - 1)
    kv.free(0)  # its full blocks stay cached
    snap = block_map(kv)
    assert [seq["blocks"] for seq in snap["seqs"]] == [[[20_001, 20_000]], [[40_001, 20_000]],
                                                        [[60_001, 20_000]]]
    assert snap["cached"] == [[1, 19_999]] and snap["cached_blocks"] == 19_999
    assert len(json.dumps(snap)) < 1000


def test_per_block_view_agrees_with_the_pool_after_random_traffic():
    rng = random.Random(1)
    kv = OwnedKV(40, 4)
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
        by_id = {b["id"]: b for b in per_block(snap)}
        for b in range(1, kv.num_blocks):
            ref, hashed = kv.pool.ref_count(b), kv.pool.block_hash(b) is not None
            blk = by_id.get(b)
            if ref:
                assert blk["state"] == "used" and blk["ref_count"] == len(blk["owners"]) == ref
                assert 1 <= blk["tokens"] <= 4 and (ref == 1 or blk["tokens"] == 4)
            elif hashed:
                assert blk == {"id": b, "state": "cached", "ref_count": 0, "tokens": 4, "owners": []}
            else:
                assert blk is None
        assert sum(b["state"] == "used" for b in by_id.values()) == snap["used_blocks"]
        assert sum(b["state"] == "cached" for b in by_id.values()) == snap["cached_blocks"]
