"""Chained prefix hashes for full KV blocks.

The hash of block ``i`` of a sequence is ``hash_fn(parent, token ids of block i)``, ``parent`` being the
hash of block ``i-1`` (None for block 0): equal hashes (barring collisions) mean equal *whole prefixes*.

Choice of the default hash: Python's built-in ``hash`` of a tuple of ints.
- It is fast (a prompt of thousands of tokens is hashed per request on the engine thread, sha256 over an
  encoding is ~10x slower) and deterministic across processes: ``PYTHONHASHSEED`` randomises str/bytes
  hashes only, never int or tuple-of-int hashes (the first block's parent is the int ROOT, not None, whose
  hash is its address before Python 3.12).
- It is not collision-free (64 bits, and not cryptographic), and it does not need to be: the hash only picks
  a bucket. A hit is always verified against the stored token ids of the block *and* the content tag of its
  parent (see ``BlockPool``), so a collision, accidental or engineered, costs a bucket scan and never shares
  a block whose K/V belong to different tokens. Tests force collisions by injecting a constant hash.

Injection: pass ``hash_fn=`` to ``KVCacheManager`` / ``BlockPool``; the default is this module's
``default_block_hash``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

# hash_fn(parent_hash or None for the first block, the block's token ids) -> any hashable value
BlockHashFn = Callable[[Hashable | None, tuple[int, ...]], Hashable]


ROOT = 0  # the first block's parent: a constant (hash(None) follows the object's address before 3.12)


def default_block_hash(parent_hash: Hashable | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: parent's hash + this block's token ids."""
    return hash((ROOT if parent_hash is None else parent_hash, token_ids))
