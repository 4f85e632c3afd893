"""The paged half of pagewalk: block pool, per-sequence block tables, prefix cache, copy-on-write forks.

Pure Python on integers; imports no torch. See docs/ARCHITECTURE.md for the contract.
"""

from kvcache.block_pool import NULL_BLOCK_ID, BlockPool
from kvcache.manager import KVCacheManager
from kvcache.prefix_hash import BlockHashFn, default_block_hash
from kvcache.usage import KVCacheUsage

__all__ = [
    "KVCacheManager", "BlockPool", "KVCacheUsage", "NULL_BLOCK_ID", "BlockHashFn", "default_block_hash",
]
