"""The engine core with prefix caching: a request's prompt hits the blocks of an earlier one only under the
same cache salt (or both without one); the salt changes no token; the core refuses a bad salt itself."""

from __future__ import annotations

import time

import pytest

from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.sampling_params import SamplingParams

PROMPT = list(range(3, 43))  # 40 tokens, block size 16: 2 full blocks before the last token's


@pytest.fixture(scope="module")
def core():
    core, _ = build_core(EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=16,
                                      num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256))
    return core


def run(core, request_id: str, salt: str | None, n: int = 1) -> tuple[int, list[list[int]]]:
    """Run a greedy request to its end -> (prompt tokens it found in the prefix cache, each choice's ids)."""
    hits = core.kv.usage().prefix_hits
    core.add_request(EngineRequest(request_id, PROMPT, SamplingParams(max_tokens=4, temperature=0.0, n=n,
                                                                      cache_salt=salt), time.monotonic()))
    outputs: dict[int, list[int]] = {}
    while core.has_work():
        for u in core.step().updates:
            outputs.setdefault(u.index, []).extend(u.new_token_ids)
    core.kv.check_integrity()
    return core.kv.usage().prefix_hits - hits, [outputs[i] for i in sorted(outputs)]


def test_a_prompt_hits_only_under_its_own_salt(core):
    first_hits, first = run(core, "a", "tenant-a", n=2)           # its n choices fork, sharing its blocks
    assert first_hits == 0 and len(first) == 2 and first[0] == first[1]
    for rid, salt in (("b", "tenant-b"), ("c", None)):
        hits, out = run(core, rid, salt)
        assert hits == 0 and out == first[:1], salt                   # computed again: the same tokens
    assert run(core, "d", "tenant-a")[0] == 32                      # both full blocks of "a"
    assert run(core, "e", "tenant-b")[0] == 32                      # of "b"
    assert run(core, "f", None)[0] == 32                            # of "c": the unsalted share as before


def test_the_core_refuses_a_bad_salt(core):
    for salt in ("", "x" * 4097, 7):
        with pytest.raises(ValueError, match="cache_salt"):
            core.add_request(EngineRequest(f"bad-{salt!r}", PROMPT, SamplingParams(cache_salt=salt),
                                           time.monotonic()))
    assert not core.has_work()
