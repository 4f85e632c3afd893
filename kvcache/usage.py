"""A frozen snapshot of KV-cache occupancy and prefix-cache statistics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheUsage:
    num_blocks: int  # total ids, the null block 0 included
    block_size: int
    free_blocks: int  # ref count 0 (cached ones included); free_blocks + used_blocks == num_blocks - 1
    used_blocks: int  # ref count >= 1
    cached_blocks: int  # ref count 0 but hashed: kept for prefix reuse, evicted LRU (counted in free_blocks)
    prefix_queries: int  # prompt tokens looked up at allocate (caching on, successful allocates only)
    prefix_hits: int  # of those, tokens served from the prefix cache
    prefix_hit_rate: float  # prefix_hits / prefix_queries, 0.0 when there were no queries

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1
