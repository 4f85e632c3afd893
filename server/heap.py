"""The collector's policy for a long-running serving process (the API process, the engine-core process).

Start-up builds a large heap that lives as long as the process: torch, Triton, FastAPI, pydantic, the
tokenizer, the model's modules, ~220-300K tracked objects. Requests allocate all the time (per token in the
API process's streams, per step in the core's scheduler), so collections run all the time, and a full
collection walks that whole heap: 30-50 ms of an API process's CPU (docs/benchmarks/api_cpu.md) and, in the
engine core, a stall of every stream while it runs (180 ms for the `tiny` core's 300K objects on this
project's CI CPU; tools/closed_loop_stalls times it for the `bench` core on a GPU host).
"""

from __future__ import annotations

import gc

FULL_COLLECTION_EVERY = 100  # collections of generation 1 per full one (Python's default: 10)


def freeze_startup_heap() -> int:
    """Moves what start-up built out of the collector's reach, once per process: a full collection then walks
    only what requests allocate. Full collections, which walk every live request's objects (~100K at 256
    streams), come 10x less often: what they free is the rare request garbage in reference cycles, which
    refcounting leaves them. -> the number of objects frozen (0: this process froze its heap before).
    The guard is this module's own: gc's freeze count can be nonzero before the first call (it is in the
    bench core on the H200 host, torch 2.11+cu130, where a full collection of the heap left unfrozen takes
    162-189 ms)."""
    global _frozen
    if _frozen:
        return 0
    _frozen = True
    before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    first, second, _ = gc.get_threshold()
    gc.set_threshold(first, second, FULL_COLLECTION_EVERY)
    return gc.get_freeze_count() - before


_frozen = False
