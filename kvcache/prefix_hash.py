"""Chained prefix hashes for full KV blocks.

The hash of block ``i`` of a sequence is ``hash_fn(parent, token ids of block i)``, ``parent`` being the
hash of block ``i-1`` (for block 0 the chain's root: None, or a cache salt's ``chain_root``): equal hashes
(barring collisions) mean equal *whole prefixes* under the same salt.

Cache salts (vLLM's ``cache_salt``): a salted prompt's chain starts at its salt's root, which is also the
parent tag its first block is matched on (see ``BlockPool``), so its blocks are found only by prompts of the
same salt: tenants that salt differently never share a block, and none learns from a fast answer that another
sent the same prefix.

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

import hashlib
import struct
from collections.abc import Callable, Hashable

# hash_fn(parent_hash or the chain's root for the first block, the block's token ids) -> any hashable value
BlockHashFn = Callable[[Hashable | None, tuple[int, ...]], Hashable]
# the first block's parent: None unsalted, else chain_root(salt)
ChainRoot = tuple[int, ...] | None


ROOT = 0  # an unsalted first block's parent hash: a constant (hash(None) is the object's address before 3.12)


def default_block_hash(parent_hash: Hashable | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: parent's hash + this block's token ids."""
    return hash((ROOT if parent_hash is None else parent_hash, token_ids))


def chain_root(cache_salt: str | None) -> ChainRoot:
    """The root of a prompt's chain: None without a salt, else a 256-bit BLAKE2b digest of the salt's UTF-8
    bytes (surrogates passed through, so any str encodes) as four 64-bit ints. Equal only for equal salts
    (barring a collision of the digest: a tenant would need a second preimage of another's secret salt),
    never equal to None or to a content tag (an int), hashed alike in every process (str hashes are
    randomised per process, int tuples are not), and of one size whatever the salt's: a salted chain's first
    block keeps its root as its parent tag for as long as it stays cached (the salt's bytes as a tuple of
    ints held 132 KB a block for a 4096-character salt: a review)."""
    if cache_salt is None:
        return None
    digest = hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=32).digest()
    return struct.unpack(">4Q", digest)
