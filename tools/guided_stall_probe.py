"""Where a guided closed loop's long decode steps go: `python -m tools.guided_stall_probe`.

The engine core as engine_step_bench builds it (bench preset on CUDA), one closed loop of --concurrency
requests in flight (64; 256 requests in all) with every request guided (engine_step_bench's :guided),
with the core's and runner's host phases timed per step: the forward's launch, the mask callback's
post-processing of the step before (its wait, its finish checks with the matchers' accept), the masks,
their copy, the sampler's launch. Prints the phases of the decode-only steps over --slow-ms (3) and the
medians of the others and of all."""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from server.engine.engine import EngineConfig, build_core
from tools.engine_step_bench import Probe, closed_loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--slow-ms", type=float, default=3.0)
    args = ap.parse_args()
    c, slow_ms = args.concurrency, args.slow_ms
    core, _ = build_core(EngineConfig(model="bench", device="cuda", dtype="bfloat16", max_num_seqs=c,
                                      max_num_batched_tokens=8192, gpu_memory_utilization=0.8))
    probe = Probe(core)  # schedule, postprocess, execute, wait
    for obj, name in ((core.grammars, "masks"), (core, "_process"), (core.runner, "forward_step"),
                      (core.runner.sampler, "_draw_step"), (core.runner.mask_packer, "send"),
                      (core.runner, "_to_host")):
        probe.wrap(obj, name)
    gcs: list = []
    gc.callbacks.append(lambda phase, info: gcs.append((phase, info["generation"], time.perf_counter())))
    steps: list = []
    step = core.step

    def traced_step():  # closed_loop gives the probe fresh phases before each step
        n_gc = len(gcs)
        t0 = time.perf_counter()
        update = step()
        wall = (time.perf_counter() - t0) * 1e3
        phases_ms = {k: v * 1e3 for k, v in probe.phases.items()}
        steps.append((wall, update.stats.num_prefill_tokens, phases_ms, len(gcs) - n_gc))
        return update

    core.step = traced_step
    closed_loop(core, c, 256, 512, 128, guided=True, probe=probe)  # warm-up: compiles, allocations
    steps.clear()
    result = closed_loop(core, c, 256, 512, 128, guided=True, probe=probe)
    decode = [s for s in steps if s[1] == 0]
    slow = [s for s in decode if s[0] > slow_ms]
    print(f"guided loop: {result['tok_s']:.0f} tok/s, {len(decode)} decode-only steps, {len(slow)} over "
          f"{slow_ms} ms; gc passes in slow steps: {sum(s[3] for s in slow)}, "
          f"in all: {sum(s[3] for s in decode)}")
    names = sorted({k for s in decode for k in s[2]})
    for label, kept in (("the others", [s for s in decode if s[0] <= slow_ms]), ("all", decode)):
        if kept:
            print(f"median of {label}: wall {statistics.median(s[0] for s in kept):.3f}, " + ", ".join(
                f"{k} {statistics.median(s[2].get(k, 0.0) for s in kept):.3f}" for k in names))
    for wall, _, ph, n_gc in slow[:25]:
        print(f"{wall:6.2f} ms gc {n_gc}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(ph.items())))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
