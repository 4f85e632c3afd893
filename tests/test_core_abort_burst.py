"""A burst of aborts reaching the core in one turn (clients hanging up together: a proxy's timeout) costs the
core loop time linear in the waiting queue (a review found it quadratic)."""
from __future__ import annotations

import time

from server.engine.core_loop import CoreLoop
from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.sampling_params import SamplingParams
from server.engine.wire import Abort, Hello


def test_ten_thousand_aborts_of_waiting_requests_take_the_core_loop_little_time():
    """10k waiting requests (--max-waiting 10000), their aborts arriving newest first: removed from the
    waiting queue one at a time, each scanned it (1.8-2.4 s of the core loop on the CI CPU, every running
    stream stalled meanwhile); now the next schedule() drops them in one pass."""
    core, info = build_core(EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=16,
                                         num_blocks=256, max_num_seqs=16, max_num_batched_tokens=256,
                                         attention_backend="torch"))
    n = 10_000
    turns = [[(b"c", Hello())],
             [(b"c", EngineRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), 0.0)) for i in range(n)]]
    aborts = [(b"c", Abort(f"r{i}")) for i in reversed(range(n))]
    sent = []
    timing = {}

    class Done(Exception):
        pass

    def receive(timeout):
        if turns:
            return turns.pop(0)
        if "t0" not in timing:
            timing["t0"] = time.perf_counter()
            return aborts
        timing["t1"] = time.perf_counter()
        raise Done

    loop = CoreLoop(core, info, receive, lambda client, msg: sent.append(msg))
    # the adds' turn steps once (16 requests start), so a few requests are running, the rest wait
    try:
        loop.run()
    except Done:
        pass
    took = timing["t1"] - timing["t0"]
    assert not core.requests
    assert took < 0.5, f"10k aborts held the core loop {took:.2f} s"
