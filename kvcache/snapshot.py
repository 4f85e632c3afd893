"""The KV block map as plain data (ints, strings and lists of them), for inspection: who holds which block.

``block_map(kv, owners)`` returns

    {"block_size": 16, "num_blocks": 512,            # ids 0..num_blocks-1; block 0 is the null block
     "free_blocks": 500, "used_blocks": 9, "cached_blocks": 3,   # as in usage(): cached ones count as free
     "seqs": [{"seq_id": 7, **owners[7], "num_tokens": 40,
               "blocks": [[12, 2], [30, 1]]},         # its block table as runs: blocks 12, 13, 30
              ...],
     "cached": [[40, 3]]}                             # free but hashed: full blocks kept for prefix reuse

Runs (``[first id, count]`` per stretch of consecutive ascending ids, in table order) keep a map of a GPU
cache small: the pool hands out fresh blocks in id order, so a table of thousands of blocks is a few runs,
and the map costs one pass over the tables and the free queue, not one record per block.

Every per-block fact follows (``per_block`` spells them out): a block is used when some table holds it, its
ref count is the number of tables that hold it (``check_integrity`` keeps that equal to the pool's count),
its owners are those tables' sequences, and at table position i it fills ``min(block_size, num_tokens - i *
block_size)`` token slots (a shared block is full, so its holders agree); a cached block holds a full block;
any other block is free. The caller takes the map between steps (the manager has one owner).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvcache.manager import KVCacheManager

Runs = list[list[int]]


def to_runs(block_ids: Iterable[int]) -> Runs:
    """``[first, count]`` per maximal stretch of ids that each follow the previous one by 1, in order."""
    runs: Runs = []
    last = -2
    for b in block_ids:
        if b == last + 1:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
        last = b
    return runs


def from_runs(runs: Iterable[Iterable[int]]) -> list[int]:
    return [b for first, count in runs for b in range(first, first + count)]


def block_map(kv: KVCacheManager, owners: Mapping[object, Mapping[str, int | str]] | None = None) -> dict:
    """The map of ``kv``; ``owners[seq_id]`` (e.g. request id and choice index) joins that seq's entry."""
    owners = owners or {}
    seqs = []
    for seq_id, seq in kv._seqs.items():  # same package: the manager lists its sequences nowhere else
        assert isinstance(seq_id, (int, str)), f"seq id {seq_id!r} is neither int nor str"
        seqs.append({"seq_id": seq_id, **owners.get(seq_id, {}), "num_tokens": seq.num_tokens,
                     "blocks": to_runs(seq.block_table)})
    u = kv.usage()
    return {"block_size": u.block_size, "num_blocks": u.num_blocks, "free_blocks": u.free_blocks,
            "used_blocks": u.used_blocks, "cached_blocks": u.cached_blocks, "seqs": seqs,
            "cached": to_runs(sorted(kv.pool.cached_block_ids()))}


def per_block(snapshot: Mapping) -> list[dict]:
    """The map one record per used or cached block, ascending ids: ``{"id", "state": "used" | "cached",
    "ref_count", "tokens", "owners": [seq entry without "blocks", ...]}``. For tests and people, not for
    a GPU cache's worth of blocks."""
    bs = snapshot["block_size"]
    blocks: dict[int, dict] = {}
    for seq in snapshot["seqs"]:
        holder = {k: v for k, v in seq.items() if k != "blocks"}
        for pos, b in enumerate(from_runs(seq["blocks"])):
            blk = blocks.setdefault(b, {"id": b, "state": "used", "ref_count": 0, "tokens": 0, "owners": []})
            blk["ref_count"] += 1
            blk["tokens"] = max(blk["tokens"], min(bs, seq["num_tokens"] - pos * bs))
            blk["owners"].append(holder)
    for b in from_runs(snapshot["cached"]):
        blocks[b] = {"id": b, "state": "cached", "ref_count": 0, "tokens": bs, "owners": []}
    return [blocks[b] for b in sorted(blocks)]
