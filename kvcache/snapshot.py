"""The KV block map as plain data (ints and strings): every block that holds K/V, for inspection.

``block_map(kv, owners)`` returns

    {"block_size": 16, "num_blocks": 512,            # ids 0..num_blocks-1; block 0 is the null block
     "free_blocks": 500, "used_blocks": 9, "cached_blocks": 3,   # as in usage(): cached ones count as free
     "blocks": [{"id": 12, "state": "used", "ref_count": 2, "tokens": 16,
                 "owners": [{"seq_id": 7, **owners[7]}, {"seq_id": 9, **owners[9]}]},
                {"id": 40, "state": "cached", "ref_count": 0, "tokens": 16, "owners": []},
                ...]}                                 # ascending ids; a free block is only counted

A used block (ref count >= 1) lists the sequences whose tables hold it; its ``tokens`` are the slots it
fills for the longest of them (a shared block is full, so they agree). A cached block is free (ref count
0) but hashed: a full block kept for prefix reuse until the pool evicts it. The cost is linear in the used
and free blocks, so the caller takes it on demand only, between steps (the manager has one owner).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvcache.manager import KVCacheManager


def block_map(kv: KVCacheManager, owners: Mapping[object, Mapping[str, int | str]] | None = None) -> dict:
    """The block map of ``kv``; ``owners[seq_id]`` (e.g. request id and choice index) labels each holder."""
    owners = owners or {}
    pool, bs = kv.pool, kv.block_size
    holders: dict[int, list[dict]] = {}
    tokens: dict[int, int] = {}
    for seq_id, seq in kv._seqs.items():  # same package: the manager lists its sequences nowhere else
        assert isinstance(seq_id, (int, str)), f"seq id {seq_id!r} is neither int nor str"
        n, holder = len(seq.token_ids), {"seq_id": seq_id, **owners.get(seq_id, {})}
        for pos, block in enumerate(seq.block_table):
            holders.setdefault(block, []).append(holder)
            tokens[block] = max(tokens.get(block, 0), min(bs, n - pos * bs))
    blocks = [{"id": b, "state": "used", "ref_count": pool.ref_count(b), "tokens": tokens[b],
               "owners": holders[b]} for b in holders]
    blocks += [{"id": b, "state": "cached", "ref_count": 0, "tokens": bs, "owners": []}
               for b in pool.cached_block_ids()]
    blocks.sort(key=lambda blk: blk["id"])
    u = kv.usage()
    return {"block_size": bs, "num_blocks": u.num_blocks, "free_blocks": u.free_blocks,
            "used_blocks": u.used_blocks, "cached_blocks": u.cached_blocks, "blocks": blocks}
