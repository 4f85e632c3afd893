"""The KV block map as plain data: which sequence holds which physical block, for the playground page.

``block_map(kv)`` returns a dict of ints, strings and lists of them (JSON / msgpack as it is):

    {"num_blocks": 512, "block_size": 16,            # ids 0..num_blocks-1; block 0 is the null block
     "free_blocks": 500, "used_blocks": 9, "cached_blocks": 3,   # as in usage(); cached count in free
     "seqs": [{"seq_id": 7, "num_tokens": 40, "num_computed_tokens": 39,
               "blocks": [[12, 2], [30, 1]], **owner},  # block table as runs: 12, 13, 30
              ...],
     "cached": [[40, 3]]}                             # ref count 0 but hashed: reusable prefix blocks

Everything else a viewer shows per block follows from it: a block is used when some table holds it, its
ref count is the number of tables that hold it (``check_integrity`` keeps that equal to the pool's count),
its owners are those tables' sequences, and it holds ``clamp(num_computed_tokens - i * block_size, 0,
block_size)`` written tokens at table position i; a cached block holds a full block, a free one nothing.
Runs (``[first id, count]`` of consecutive ascending ids) keep the map small: the pool hands out fresh
blocks in id order, so a table of thousands of blocks is usually a few runs.

Reads the manager and its pool without changing them; the caller takes it between steps (one owner).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvcache.manager import KVCacheManager

Runs = list[list[int]]


def to_runs(block_ids: Iterable[int]) -> Runs:
    """``[first, count]`` per maximal stretch of ids that each follow the previous one by 1, in order."""
    runs: Runs = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return runs


def from_runs(runs: Iterable[Iterable[int]]) -> list[int]:
    return [b for first, count in runs for b in range(first, first + count)]


def block_map(kv: KVCacheManager, owners: Mapping[object, Mapping[str, int | str]] | None = None) -> dict:
    """The block map of ``kv``; ``owners[seq_id]`` (e.g. request id and choice index) joins each seq entry."""
    owners = owners or {}
    usage = kv.usage()
    seqs = []
    for seq_id, seq in kv._seqs.items():  # same package: the manager lists no seqs publicly
        assert isinstance(seq_id, (int, str)), f"seq id {seq_id!r} is neither int nor str"
        seqs.append({"seq_id": seq_id, "num_tokens": len(seq.token_ids),
                     "num_computed_tokens": seq.num_computed_tokens,
                     "blocks": to_runs(seq.block_table), **owners.get(seq_id, {})})
    return {
        "num_blocks": usage.num_blocks, "block_size": usage.block_size,
        "free_blocks": usage.free_blocks, "used_blocks": usage.used_blocks,
        "cached_blocks": usage.cached_blocks,
        "seqs": seqs,
        "cached": to_runs(sorted(kv.pool.cached_block_ids())),
    }


def block_owners(snapshot: Mapping) -> dict[int, list[int | str]]:
    """Block id -> seq ids holding it (ref count = length), for every used block of a snapshot."""
    held: dict[int, list[int | str]] = {}
    for seq in snapshot["seqs"]:
        for b in from_runs(seq["blocks"]):
            held.setdefault(b, []).append(seq["seq_id"])
    return held
