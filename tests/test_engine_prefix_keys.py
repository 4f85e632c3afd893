"""A request's prompt is hashed for the prefix cache once, when it arrives; the keys go once it runs."""

from __future__ import annotations

import time

from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.sampling_params import SamplingParams


def test_a_request_arrives_with_its_prefix_keys_and_drops_them_once_running():
    core, _ = build_core(EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=16,
                                      max_num_seqs=4, max_num_batched_tokens=256))
    ids = list(range(3, 43))                                   # 40 tokens: 2 full blocks before the last
    core.add_request(EngineRequest("a", ids, SamplingParams(max_tokens=2, temperature=0.0, n=2),
                                   time.monotonic()))
    seqs = core.requests["a"].seqs
    blocks = [tuple(ids[:16]), tuple(ids[16:32])]
    assert [[tokens for _, tokens in s.prefix_keys] for s in seqs] == [blocks, blocks]
    while core.has_work():
        core.step()
    assert [s.prefix_keys for s in seqs] == [[], []]          # the parent admitted, the child forked
    core.add_request(EngineRequest("b", ids, SamplingParams(max_tokens=1, temperature=0.0), time.monotonic()))
    core.step()
    assert core.kv.usage().prefix_hits >= 32                   # the keys found both blocks of "a"
