"""Is a guided step's long mask one matcher's or every row's? `python -m tools.guided_row_probe`.

tools/guided_stall_probe found 8-41 of ~500 decode steps of a 64-wide guided closed loop spending 3-10 ms in
Grammars.masks (median 0.16-0.31 ms). Here the same loop computes each step's masks row by row on the core's
thread, each row timed: a step whose time sits in one row names that matcher's state (how many tokens it
consumed), a step whose rows are all slow names the host (the thread descheduled, memory). Prints the slow
steps: wall, the slowest row's time, its index and tokens consumed, the median row."""

from __future__ import annotations

import statistics
import time

from server.engine.engine import EngineConfig, build_core
from server.engine.grammar import Grammars
from tools.engine_step_bench import closed_loop

SLOW_MS = 1.5


def main() -> None:
    core, _ = build_core(EngineConfig(model="bench", device="cuda", dtype="bfloat16", max_num_seqs=64,
                                      max_num_batched_tokens=8192, gpu_memory_utilization=0.8))
    grammars = core.grammars
    grammars._executor = None  # rows one after another, each timed (cached_property: set on the instance)
    steps: list = []
    consumed: dict[int, int] = {}
    accept = Grammars.accept

    def counted_accept(matcher, token):
        consumed[id(matcher)] = consumed.get(id(matcher), 0) + 1
        return accept(matcher, token)

    def timed_masks(matchers, costly=None, owners=None, lanes=None):
        rows = []
        start = time.perf_counter()
        for m in matchers:
            t0 = time.perf_counter()
            grammars_masks([m])
            rows.append(((time.perf_counter() - t0) * 1e3, consumed.get(id(m), 0)))
        steps.append(((time.perf_counter() - start) * 1e3, rows))
        return grammars_masks(matchers, costly, owners, lanes)

    grammars_masks = grammars.masks
    grammars.accept = counted_accept
    grammars.masks = timed_masks
    closed_loop(core, 64, 256, 512, 128, guided=True)  # warm-up
    steps.clear()
    result = closed_loop(core, 64, 256, 512, 128, guided=True)
    slow = [s for s in steps if s[0] > SLOW_MS]
    print(f"guided loop (rows timed): {result['tok_s']:.0f} tok/s, {len(steps)} mask calls, {len(slow)} over "
          f"{SLOW_MS} ms; median call {statistics.median(s[0] for s in steps):.3f} ms")
    for wall, rows in slow[:30]:
        times = [t for t, _ in rows]
        worst = max(range(len(rows)), key=lambda i: rows[i][0])
        print(f"{wall:6.2f} ms over {len(rows)} rows: slowest row {rows[worst][0]:.2f} ms (row {worst}, "
              f"{rows[worst][1]} tokens consumed), median row {statistics.median(times):.3f}, rows over "
              f"0.5 ms: {sum(t > 0.5 for t in times)}")


if __name__ == "__main__":
    main()
