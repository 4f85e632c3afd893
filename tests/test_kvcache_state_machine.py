"""Property test: random allocate/append/mark_computed/fork/free against a reference model.

Besides ``check_integrity()`` after every step, the model checks, independently of the implementation:
- every table has ceil(tokens / block_size) blocks and no block is shared unless it is full in every table;
- the exact free-queue order (an LRU list model: take from the front, push freed blocks tail-first);
- the K/V *contents*: a fake cache maps each slot to the cache salt and full token prefix whose K/V it holds
  (written on mark_computed, copied on fork). Every computed token of every live sequence must find its own
  salt and prefix in its slot, so a prefix hit on a wrong block, or on another salt's block, or a write into
  a shared block is caught;
- out-of-blocks returns leave everything unchanged, and can_allocate() True implies allocate succeeds.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvcache_owner import OwnedKV

from kvcache import KVCacheManager

HASHES = {
    "default": None,
    "weak": lambda parent, tokens: hash((parent, tokens)) % 3,  # frequent collisions
    "const": lambda parent, tokens: 0,  # every block collides
}


def snapshot(mgr: KVCacheManager):
    pool = mgr.pool
    return ([pool.ref_count(b) for b in range(pool.num_blocks)], pool.free_queue_ids(),
            [pool.block_hash(b) for b in range(pool.num_blocks)],
            {s: (mgr.block_table(s), mgr.num_tokens(s), mgr.num_cached_tokens(s)) for s in list(mgr._seqs)},
            mgr.usage())


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(bs=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(2, 32), caching=st.booleans(),
                hash_name=st.sampled_from(sorted(HASHES)))
    def setup(self, bs, num_blocks, caching, hash_name):
        self.bs = bs
        self.mgr = OwnedKV(num_blocks, bs, enable_prefix_caching=caching, hash_fn=HASHES[hash_name])
        self.tokens: dict[int, list] = {}  # seq -> token ids (unknown ids: unique placeholders)
        self.salts: dict[int, str | None] = {}  # seq -> its cache salt
        self.computed: dict[int, int] = {}
        self.kv: dict[int, tuple] = {}  # slot -> (cache salt, the token prefix) whose K/V it holds
        self.queue = list(range(1, num_blocks))  # model of the free queue
        self.ids = itertools.count()
        self.unknown = itertools.count()
        self.history: list[list[int]] = []  # known token ids of sequences seen, for prefix reuse

    # ---- helpers -------------------------------------------------------------------------------------
    def pick(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)))

    def take_front(self, blocks):
        assert blocks == self.queue[:len(blocks)], f"new blocks {blocks}, queue {self.queue}"
        del self.queue[:len(blocks)]

    def write(self, seq, start, end):
        table, toks = self.mgr.block_table(seq), self.tokens[seq]
        for p in range(start, end):
            self.kv[table[p // self.bs] * self.bs + p % self.bs] = (self.salts[seq], tuple(toks[:p + 1]))

    # ---- rules ---------------------------------------------------------------------------------------
    @rule(data=st.data(), prefill=st.booleans())
    def allocate(self, data, prefill):
        base = []
        if self.history and data.draw(st.integers(0, 2)):  # reuse a known prefix (live or freed): hits
            base = data.draw(st.sampled_from(self.history))
            base = base[:data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))]
        toks = base + data.draw(st.lists(st.integers(0, 2), min_size=0 if base else 1, max_size=12))
        salt = data.draw(st.sampled_from([None, None, "a", "b"]))  # drawn apart from the prefix: salts cross
        seq = next(self.ids)
        can = self.mgr.can_allocate(len(toks))
        before = snapshot(self.mgr)
        table = self.mgr.allocate(seq, toks, cache_salt=salt)
        if table is None:
            event("allocate: out of blocks")
            assert not can, "can_allocate() said yes but allocate failed"
            assert snapshot(self.mgr) == before, "failed allocate changed state"
            return
        cached = self.mgr.num_cached_tokens(seq)
        assert 0 <= cached < len(toks) and cached % self.bs == 0
        if not self.mgr.enable_prefix_caching:
            assert cached == 0
        hits = table[:cached // self.bs]
        revived = [b for b in hits if b in self.queue]
        event("allocate: prefix hit" if hits else "allocate: miss")
        if revived:
            event("allocate: hit revives cached blocks")
        if len(revived) < len(hits):
            event("allocate: hit on a block in use")
        self.queue = [b for b in self.queue if b not in hits]
        self.take_front(table[len(hits):])
        self.tokens[seq] = list(toks)
        self.salts[seq] = salt
        self.history.append(toks)
        self.computed[seq] = cached  # hit slots must already hold our prefix (checked by the invariant)
        if prefill:  # the runner computes the rest of the prompt right away
            self.write(seq, cached, len(toks))
            self.mgr.mark_computed(seq, len(toks))
            self.computed[seq] = len(toks)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 5), known=st.booleans())
    def append(self, data, n, known):
        seq = self.pick(data)
        toks = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)) if known else None
        old_table = self.mgr.block_table(seq)
        before = snapshot(self.mgr)
        if not self.mgr.append_slots(seq, n, toks):
            assert snapshot(self.mgr) == before, "failed append changed state"
            assert -(-(len(self.tokens[seq]) + n) // self.bs) - len(old_table) > len(self.queue)
            return
        table = self.mgr.block_table(seq)
        assert table[:len(old_table)] == old_table
        self.take_front(table[len(old_table):])
        self.tokens[seq] += toks if known else [("u", next(self.unknown)) for _ in range(n)]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(0, 16))
    def mark_computed(self, data, k):
        seq = self.pick(data)
        new = min(self.computed[seq] + k, len(self.tokens[seq]))
        self.write(seq, self.computed[seq], new)  # the runner writes K/V, then tells the cache
        self.mgr.mark_computed(seq, new)
        self.computed[seq] = new

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent, child = self.pick(data), next(self.ids)
        before = snapshot(self.mgr)
        copies = self.mgr.fork(parent, child)
        if copies is None:
            assert snapshot(self.mgr) == before, "failed fork changed state"
            assert len(self.tokens[parent]) % self.bs and not self.queue
            return
        ptable, ctable = self.mgr.block_table(parent), self.mgr.block_table(child)
        n_full = len(self.tokens[parent]) // self.bs
        assert ctable[:n_full] == ptable[:n_full]
        if len(self.tokens[parent]) % self.bs:
            assert copies == [(ptable[-1], ctable[-1])] and ctable[-1] != ptable[-1]
            event("fork: copy-on-write")
            self.take_front([ctable[-1]])
        else:
            assert copies == [] and ctable == ptable
        for src, dst in copies:  # the runner's copy-on-write
            for o in range(self.bs):
                if src * self.bs + o in self.kv:
                    self.kv[dst * self.bs + o] = self.kv[src * self.bs + o]
        self.tokens[child] = list(self.tokens[parent])
        self.salts[child] = self.salts[parent]
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = self.pick(data)
        table = self.mgr.block_table(seq)
        self.mgr.free(seq)
        known = list(itertools.takewhile(lambda t: isinstance(t, int), self.tokens[seq]))
        self.history.append(known)
        del self.tokens[seq], self.computed[seq], self.salts[seq]
        held = {b for s in self.tokens for b in self.mgr.block_table(s)}
        self.queue += [b for b in reversed(table) if b not in held]

    # ---- invariants ----------------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        self.mgr.check_integrity()

    @invariant()
    def model_agrees(self):
        mgr, bs = self.mgr, self.bs
        assert mgr.pool.free_queue_ids() == self.queue
        positions: dict[int, list[tuple[int, bool]]] = {}
        for seq, toks in self.tokens.items():
            table = mgr.block_table(seq)
            assert mgr.num_tokens(seq) == len(toks)
            assert len(table) == -(-len(toks) // bs)
            for i, b in enumerate(table):
                positions.setdefault(b, []).append((seq, (i + 1) * bs <= len(toks)))
            for p in range(self.computed[seq]):
                slot = table[p // bs] * bs + p % bs
                assert self.kv.get(slot) == (self.salts[seq], tuple(toks[:p + 1])), \
                    f"seq {seq}: slot {slot} holds wrong K/V"
        for b, holders in positions.items():
            assert b != 0
            assert mgr.pool.ref_count(b) == len(holders)
            if len(holders) > 1:
                assert all(full for _, full in holders), f"block {b} shared while partial: {holders}"
        u = mgr.usage()
        assert u.free_blocks + u.used_blocks == mgr.num_blocks - 1
        assert u.free_blocks == len(self.queue) and u.cached_blocks <= u.free_blocks
        if not mgr.enable_prefix_caching:
            assert u.cached_blocks == 0 and u.prefix_queries == 0
        assert u.prefix_hit_rate == (u.prefix_hits / u.prefix_queries if u.prefix_queries else 0.0)


KVCacheMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_kvcache_state_machine = KVCacheMachine.TestCase
