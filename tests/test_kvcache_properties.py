"""Property tests of the prefix-cache hit length and of slot_mapping against simple models."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from kvcache_owner import OwnedKV

prompts_st = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=20), min_size=1, max_size=8)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=120, deadline=None)
@given(bs=st.sampled_from([1, 2, 4, 8]), prompts=prompts_st, frees=st.lists(st.booleans(), min_size=8),
       hash_name=st.sampled_from(["default", "const"]))
def test_hit_length_is_longest_cached_full_block_prefix(bs, prompts, frees, hash_name):
    """With no eviction (pool large enough), the hit is the longest common full-block prefix with any earlier
    computed prompt, minus the block of the last token; colliding hashes change nothing."""
    hash_fn = (lambda p, t: 0) if hash_name == "const" else None
    mgr = OwnedKV(1 + sum(-(-len(p) // bs) for p in prompts), bs, hash_fn=hash_fn)
    seen: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        best = max((common_prefix(prompt, prev) for prev in seen), default=0) // bs
        assert mgr.allocate(i, prompt) is not None
        assert mgr.num_cached_tokens(i) == min(best, (len(prompt) - 1) // bs) * bs
        mgr.mark_computed(i, len(prompt))
        if frees[i]:
            mgr.free(i)
        seen.append(prompt)
        mgr.check_integrity()
    u = mgr.usage()
    assert u.prefix_queries == sum(map(len, prompts))


@settings(max_examples=60, deadline=None)
@given(bs=st.sampled_from([1, 2, 4, 16, 256]), lens=st.lists(st.integers(1, 600), min_size=1, max_size=4))
def test_slot_mapping_covers_distinct_slots(bs, lens):
    mgr = OwnedKV(1 + sum(-(-n // bs) for n in lens), bs)
    all_slots: list[int] = []
    for i, n in enumerate(lens):
        table = mgr.allocate(i, [0] * n)  # same tokens everywhere, but nothing is computed: no sharing
        slots = mgr.slot_mapping(i, 0, n)
        assert slots == [table[t // bs] * bs + t % bs for t in range(n)]
        assert all(bs <= s < mgr.num_blocks * bs for s in slots)  # never the null block's slots
        all_slots += slots
    assert len(set(all_slots)) == len(all_slots)
