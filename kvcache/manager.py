"""KVCacheManager: per-sequence block tables on top of a BlockPool (pure Python, ints only).

A sequence's table covers all its token slots, ``ceil(num_tokens / block_size)`` blocks, growing one block at
a time; its last block may be partial. Full blocks whose K/V are written (``mark_computed``) are registered
in the prefix cache with a chained hash, so a later prompt with the same prefix reuses them. A sequence
with a cache salt (``allocate``'s ``cache_salt``) chains from its salt's root: it shares blocks only with
sequences of the same salt, its forks included.

The manager keeps slots and blocks, not the sequence's tokens: their owner (the engine's Sequence) passes its
token ids to ``allocate`` (prefix lookup) and ``mark_computed`` (hashing the blocks that just filled up), so
a slot may be appended before its token id is known (the token is still being sampled on the device).

Rules that keep writes safe (checked by ``check_integrity``):
- Only full blocks are ever shared (prefix hits, ``fork``), and full blocks are never written again.
- The block that receives a sequence's next token is never shared: a prefix hit never covers the block
  holding the last prompt token (``num_cached_tokens < len(token_ids)``, so the caller always computes at
  least one token and gets logits), and ``fork`` gives the child its own copy of a partial last block.
- Out of blocks is a return value (``None`` / ``False``) and changes nothing.
- Misuse (unknown seq id, reused seq id, bad counts) raises ``KeyError`` / ``ValueError``.

Not thread-safe: one owner (the engine thread) calls it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from kvcache.block_pool import NULL_BLOCK_ID, BlockPool
from kvcache.prefix_hash import BlockHashFn, ChainRoot, chain_root
from kvcache.usage import KVCacheUsage


class _Seq:
    __slots__ = ("block_table", "num_tokens", "num_cached_tokens", "num_hashed_blocks", "root")

    def __init__(self, block_table: list[int], num_tokens: int, num_cached_tokens: int,
                 num_hashed_blocks: int, root: ChainRoot):
        self.block_table = block_table
        self.num_tokens = num_tokens  # slots reserved
        self.num_cached_tokens = num_cached_tokens  # prefix-cache hit found at allocate
        self.num_hashed_blocks = num_hashed_blocks  # blocks [0, this) are in the prefix cache
        self.root = root  # its chain's root: its first block's parent in the prefix cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: BlockHashFn | None = None):
        # any positive size pages correctly; the kernels' own rule (kernels.check_block_size) is the runner's
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, hash_fn=hash_fn)
        self._block_size = block_size
        self._seqs: dict[object, _Seq] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0

    # ---- properties ----------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: free ones, cached (evictable) ones included."""
        return self.pool.num_free_blocks

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _seq(self, seq_id: object) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    # ---- allocation ----------------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int) -> bool:
        """Conservative: True if ``num_tokens`` fit even with no prefix hit; then ``allocate`` succeeds."""
        return self._num_blocks_for(num_tokens) <= self.pool.num_free_blocks

    def prefix_keys(self, token_ids: Sequence[int], cache_salt: str | None = None
                    ) -> list[tuple[Hashable, tuple[int, ...]]]:
        """The prefix-cache keys of a prompt's full blocks but the last token's (empty with caching off):
        computed once when a request arrives, then passed to every ``allocate`` of its sequence (with the
        same ``cache_salt``), so an admission looks its cached prefix up without hashing it again."""
        if not self.pool.enable_caching or not token_ids:
            return []
        return self.pool.prefix_keys(token_ids, self._block_size, (len(token_ids) - 1) // self._block_size,
                                     chain_root(cache_salt))

    def _find_cached_prefix(self, token_ids: list[int], keys: Sequence[tuple[Hashable, tuple[int, ...]]],
                            root: ChainRoot) -> list[int]:
        """Cached blocks holding the longest prefix of full blocks, never the block of the last token."""
        if not self.pool.enable_caching:
            return []
        return self.pool.cached_prefix(token_ids, self._block_size, (len(token_ids) - 1) // self._block_size,
                                       keys, root)

    def allocate(self, seq_id: object, token_ids: Sequence[int],
                 prefix_keys: Sequence[tuple[Hashable, tuple[int, ...]]] = (),
                 keep_free: int = 0, counts_lookup: bool = True,
                 cache_salt: str | None = None) -> list[int] | None:
        """Reserve slots for all ``token_ids``, reusing cached prefix blocks.

        None (and no change) if out of blocks, or if fewer than ``keep_free`` free blocks would be left
        (the scheduler's room for running decodes: only the blocks this takes count, not its hits). The
        hit length is ``num_cached_tokens(seq_id)``. ``prefix_keys``: ``prefix_keys(p)`` of a prefix ``p``
        of ``token_ids`` (the prompt), if the caller keeps them. ``counts_lookup`` False: the lookup
        stays out of the prefix-cache counters (a preempted sequence's recompute finds its own old blocks;
        the counters count each prompt's first lookup, as vLLM's do). ``cache_salt``: the sequence finds
        and registers blocks in its salt's chain only (None: the unsalted one); ``prefix_keys`` must be
        computed with the same salt.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("allocate needs at least one token")
        root = chain_root(cache_salt)
        hits = self._find_cached_prefix(token_ids, prefix_keys, root)
        num_new = self._num_blocks_for(len(token_ids)) - len(hits)
        num_revived = self.pool.num_unreferenced(hits)  # these leave the free queue
        if num_new + keep_free > self.pool.num_free_blocks - num_revived:
            return None
        self.pool.touch(hits)  # before take_new, so the hits cannot be evicted
        table = hits + self.pool.take_new(num_new)
        num_cached = len(hits) * self._block_size
        self._seqs[seq_id] = _Seq(table, len(token_ids), num_cached, len(hits), root)
        if self.pool.enable_caching and counts_lookup:
            self._prefix_queries += len(token_ids)
            self._prefix_hits += num_cached
        return list(table)

    def append_slots(self, seq_id: object, n: int) -> bool:
        """Grow by ``n`` slots; False (and no change) if out of blocks."""
        seq = self._seq(seq_id)
        if n < 0:
            raise ValueError(f"append_slots: n must be >= 0, got {n}")
        num_new = self._num_blocks_for(seq.num_tokens + n) - len(seq.block_table)
        if num_new > 0:  # most decode steps fit in the last block
            if num_new > self.pool.num_free_blocks:
                return False
            seq.block_table.extend(self.pool.take_new(num_new))
        seq.num_tokens += n
        return True

    def ensure_slots(self, seq_id: object, num_tokens: int) -> bool:
        """Grow to ``num_tokens`` slots if it holds fewer (the owner's token count, one call per step);
        False (and no change) if out of blocks."""
        seq = self._seq(seq_id)
        n = num_tokens - seq.num_tokens
        if n <= 0:
            return True
        if num_tokens <= len(seq.block_table) * self._block_size:  # most decode steps: room in the last block
            seq.num_tokens = num_tokens
            return True
        return self.append_slots(seq_id, n)

    def mark_computed(self, seq_id: object, num_tokens: int, token_ids: Sequence[int]) -> None:
        """K/V of tokens [0, num_tokens) are written; ``token_ids`` (the owner's list, at least that long)
        holds their ids: register the full blocks among them in the prefix cache.

        Monotonic (a smaller count than before changes nothing); reads only the blocks not yet hashed.
        """
        seq = self._seq(seq_id)
        if not 0 <= num_tokens <= min(seq.num_tokens, len(token_ids)):
            raise ValueError(
                f"mark_computed: {num_tokens} outside [0, {min(seq.num_tokens, len(token_ids))}]")
        if not self.pool.enable_caching:
            return
        bs, table = self._block_size, seq.block_table
        i = seq.num_hashed_blocks
        while i < num_tokens // bs:
            self.pool.register(table[i], table[i - 1] if i else None, tuple(token_ids[i * bs:(i + 1) * bs]),
                               seq.root)
            i += 1
        seq.num_hashed_blocks = i

    def fork(self, parent_id: object, child_id: object) -> list[tuple[int, int]] | None:
        """Child shares the parent's full blocks and gets a copy of its partial last block.

        Returns the (src_block, dst_block) copies the runner must do; None (no change) if out of blocks.
        The child inherits the parent's slot count, hashed blocks, ``num_cached_tokens`` and cache salt.
        """
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        parent = self._seq(parent_id)
        num_full = parent.num_tokens // self._block_size
        partial = len(parent.block_table) > num_full
        if partial and self.pool.num_free_blocks < 1:
            return None
        table = parent.block_table[:num_full]
        self.pool.touch(table)
        copies = []
        if partial:
            dst = self.pool.take_new(1)[0]
            copies.append((parent.block_table[-1], dst))
            table.append(dst)
        self._seqs[child_id] = _Seq(table, parent.num_tokens, parent.num_cached_tokens,
                                    parent.num_hashed_blocks, parent.root)
        return copies

    def free(self, seq_id: object) -> None:
        """Drop the sequence. Its blocks go back tail-first, so its head blocks stay cached the longest."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        self.pool.release(reversed(seq.block_table))

    # ---- queries -------------------------------------------------------------------------------------
    def has_seq(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: object) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def table_view(self, seq_id: object) -> Sequence[int]:
        """The live block table (no copy): valid until the sequence is freed; the caller must not modify it.
        The runner syncs its device copy from it every step."""
        return self._seq(seq_id).block_table

    def num_tokens(self, seq_id: object) -> int:
        return self._seq(seq_id).num_tokens

    def num_cached_tokens(self, seq_id: object) -> int:
        return self._seq(seq_id).num_cached_tokens

    def slot_mapping(self, seq_id: object, start: int, end: int) -> list[int]:
        """Physical slot ``block_id * block_size + offset`` of each token in [start, end)."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(f"slot_mapping: [{start}, {end}) outside [0, {seq.num_tokens}]")
        bs, table = self._block_size, seq.block_table
        return [table[t // bs] * bs + t % bs for t in range(start, end)]

    def usage(self) -> KVCacheUsage:
        q, h = self._prefix_queries, self._prefix_hits
        return KVCacheUsage(
            num_blocks=self.pool.num_blocks, block_size=self._block_size,
            free_blocks=self.pool.num_free_blocks, used_blocks=self.pool.num_used_blocks,
            cached_blocks=self.pool.num_cached_blocks, prefix_queries=q, prefix_hits=h,
            prefix_hit_rate=h / q if q else 0.0)

    # ---- invariants ----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant. O(blocks + tokens): for tests/debug."""

        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise AssertionError(f"KVCacheManager integrity: {msg}")

        pool, bs = self.pool, self._block_size
        pool.check_integrity()
        holders: Counter[int] = Counter()
        for sid, seq in self._seqs.items():
            table, n = seq.block_table, seq.num_tokens
            check(n >= 1, f"seq {sid!r} has no tokens")
            check(len(table) == self._num_blocks_for(n),
                  f"seq {sid!r}: {len(table)} blocks for {n} tokens (block_size {bs})")
            check(len(set(table)) == len(table), f"seq {sid!r}: a block appears twice in its table")
            check(NULL_BLOCK_ID not in table, f"seq {sid!r}: null block 0 in its table")
            check(all(0 < b < pool.num_blocks for b in table), f"seq {sid!r}: a block id outside the pool")
            check(0 <= seq.num_cached_tokens < n, f"seq {sid!r}: num_cached_tokens {seq.num_cached_tokens} "
                                                  f"not in [0, {n})")
            check(seq.num_cached_tokens % bs == 0, f"seq {sid!r}: a prefix hit of part of a block")
            check(seq.num_hashed_blocks * bs <= n, f"seq {sid!r}: more blocks hashed than it fills")
            holders.update(table)
            for i, block_id in enumerate(table):
                full = (i + 1) * bs <= n
                check(full or pool.ref_count(block_id) == 1,
                      f"seq {sid!r}: partial block {block_id} (the next write target) is shared "
                      f"(ref count {pool.ref_count(block_id)})")
                hashed = pool.block_hash(block_id) is not None
                check(hashed or i >= seq.num_hashed_blocks, f"seq {sid!r}: block {block_id} lost its hash")
                if hashed:
                    check(full, f"seq {sid!r}: partial block {block_id} is hashed")
                    parent_tag = pool.block_tag(table[i - 1]) if i else seq.root
                    check(pool.block_parent_tag(block_id) == parent_tag,
                          f"seq {sid!r}: hashed block {block_id} chains on another prefix")
        for block_id in range(1, pool.num_blocks):
            check(pool.ref_count(block_id) == holders[block_id],
                  f"block {block_id}: ref count {pool.ref_count(block_id)} != {holders[block_id]} tables")
