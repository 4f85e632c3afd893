"""Cache salts: a salted prompt shares prefix-cache blocks only with prompts of the same salt (exact block
ids), through every path that finds or registers blocks: prefix keys, the lookup past them, forks and the
blocks generated after the prompt; even when every hash collides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvcache_owner import OwnedKV

from kvcache import KVCacheManager, default_block_hash
from kvcache.prefix_hash import chain_root

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # block size 4: two full blocks before the last token's


def const_hash(parent, tokens):
    return 0


def cached(mgr: OwnedKV, salt: str | None, seq_id: str = "probe") -> list[int]:
    """The blocks a new sequence of PROMPT and `salt` takes from the prefix cache (then freed)."""
    table = mgr.allocate(seq_id, PROMPT, cache_salt=salt)
    hits = table[:mgr.num_cached_tokens(seq_id) // mgr.block_size]
    mgr.check_integrity()
    mgr.free(seq_id)
    return hits


def computed(mgr: OwnedKV, seq_id: str, salt: str | None) -> list[int]:
    """Allocate PROMPT under `salt`, write all of it, free it: its full blocks stay cached. -> its table."""
    table = mgr.allocate(seq_id, PROMPT, cache_salt=salt)
    mgr.mark_computed(seq_id, len(PROMPT))
    mgr.free(seq_id)
    return table


@pytest.mark.parametrize("hash_fn", [None, const_hash], ids=["default", "every-hash-collides"])
def test_a_salted_prompt_shares_blocks_with_its_own_salt_only(hash_fn):
    mgr = OwnedKV(16, 4, hash_fn=hash_fn)
    assert computed(mgr, "a", "tenant-a") == [1, 2, 3]
    assert cached(mgr, "tenant-b") == []              # the same prompt under another salt
    assert cached(mgr, None) == []                    # and without one
    assert cached(mgr, "tenant-a") == [1, 2]          # its own salt finds both full blocks
    unsalted = computed(mgr, "u", None)               # the unsalted prompt computes blocks of its own
    assert unsalted == [11, 12, 13] and cached(mgr, None) == [11, 12]
    assert cached(mgr, "tenant-a") == [1, 2]          # both chains stay cached side by side
    assert mgr.usage().prefix_hits == 4 * 2 * 3       # each hit counts as any other
    mgr.check_integrity()


def test_an_unsalted_prompt_shares_as_before():
    mgr = OwnedKV(16, 4)
    assert computed(mgr, "a", None) == [1, 2, 3]
    assert cached(mgr, None) == [1, 2]
    assert cached(mgr, "s") == []


def test_the_salt_roots_the_whole_chain():
    mgr = OwnedKV(16, 4)
    plain, salted, other = (mgr.prefix_keys(PROMPT, salt) for salt in (None, "s", "t"))
    assert [tokens for _, tokens in plain] == [tokens for _, tokens in salted] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    for keys in (salted, other):
        assert all(h != p for (h, _), (p, _) in zip(keys, plain, strict=True))  # every block's hash differs
    assert all(h != o for (h, _), (o, _) in zip(salted, other, strict=True))
    assert mgr.prefix_keys(PROMPT, "s") == salted                            # and is the same for the salt


def test_keys_computed_beforehand_and_the_lookup_past_them_agree():
    """An admission uses the keys computed on arrival; a recompute after preemption hashes in the lookup."""
    mgr = KVCacheManager(16, 4)
    mgr.allocate("a", PROMPT, cache_salt="s")
    mgr.mark_computed("a", len(PROMPT), PROMPT)
    mgr.free("a")
    keys = mgr.prefix_keys(PROMPT, "s")
    for seq_id, prefix_keys in (("arrival", keys), ("recompute", ()), ("partial", keys[:1])):
        table = mgr.allocate(seq_id, PROMPT, prefix_keys, cache_salt="s")
        assert table[:2] == [1, 2] and mgr.num_cached_tokens(seq_id) == 8, seq_id
        mgr.free(seq_id)
    table = mgr.allocate("wrong-salt", PROMPT, keys, cache_salt="t")  # misuse: the root's tag still refuses
    assert mgr.num_cached_tokens("wrong-salt") == 0 and table[:2] != [1, 2]
    mgr.check_integrity()


@pytest.mark.parametrize("hash_fn", [None, const_hash], ids=["default", "every-hash-collides"])
def test_a_fork_and_its_generated_blocks_stay_in_the_salt(hash_fn):
    mgr = OwnedKV(32, 4, hash_fn=hash_fn)
    mgr.allocate("p", PROMPT, cache_salt="s")
    mgr.mark_computed("p", len(PROMPT))
    mgr.fork("p", "c")
    for seq_id in ("p", "c"):                          # each generates 3 tokens: block 3 fills up
        assert mgr.append_slots(seq_id, 3, [10, 11, 12])
        mgr.mark_computed(seq_id, 12)
    mgr.check_integrity()
    grown = PROMPT[:8] + [9, 10, 11, 12, 13]
    for salt, hit in ((None, 0), ("t", 0), ("s", 12)):
        mgr.allocate("q", grown, cache_salt=salt)
        assert mgr.num_cached_tokens("q") == hit, salt
        mgr.check_integrity()
        mgr.free("q")


def test_salts_differ_by_any_character():
    assert chain_root(None) is None
    roots = {chain_root(s) for s in ("a", "b", "A", "a ", "é", "e\u0301", "x" * 128, "\ud800")}
    assert len(roots) == 8


def test_a_salts_root_is_one_size_whatever_the_salts():
    """A salted chain's first block keeps its root for as long as it stays cached: the root is a digest of
    four ints, not the salt's bytes (a 4096-character salt held 132 KB a cached block: a review)."""
    short, long = chain_root("a"), chain_root("界" * 4096)
    assert len(short) == len(long) == 4 and all(isinstance(x, int) for x in long)
    assert chain_root("界" * 4096) == long  # equal salts, equal roots


def test_a_salted_hash_is_the_same_in_every_process():
    """str hashes are randomised per process: the root is bytes as ints, whose hash is not."""
    code = ("from kvcache import default_block_hash; from kvcache.prefix_hash import chain_root; "
            "print(default_block_hash(chain_root('tenant-a'), (1, 2, 3)))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    outs = {subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONHASHSEED": seed}, check=True,
                           capture_output=True, text=True).stdout for seed in ("1", "2")}
    assert outs == {f"{default_block_hash(chain_root('tenant-a'), (1, 2, 3))}\n"}
