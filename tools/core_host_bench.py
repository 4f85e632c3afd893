"""The engine core's own host work per step, the device's work stubbed out: `python -m tools.core_host_bench`.

A real EngineCore (`tiny` preset, CPU, async scheduling, prefix caching) whose step does everything but
run the model:
- `decode` (--batches): B sequences decode; `runner.execute` is replaced by one that returns a random token
  per sample at once, so a step times the scheduler (slots, preemption checks), the KV-cache manager, the
  post-processing (block registration, token appends, finish checks) and the StepUpdate, the Python that
  runs whatever the device is (on a GPU host it runs while the device computes; it must not grow past it);
- `prefix-hit`: the prefix-cache-hit step of issue 20 (32 requests whose first 496 tokens are cached, 16
  new tokens each), the runner real but its transformer forward replaced by zeros, so the admission's
  prefix walks, the input packing and the post-processing are timed; its two steps (launch, then the
  chunks' samples beside a decode launch) are reported with their phases.
Noise: the machine's speed moves between runs, so each figure is the minimum of --repeats medians; compare
trees by interleaving runs (docs/benchmarks/core_host_cpu.md).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.runner import StepResult
from server.engine.sampling_params import SamplingParams

PROMPT_LEN = 512


def new_core(num_blocks: int, max_num_seqs: int):
    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=16, num_blocks=num_blocks,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, attention_backend="torch",
                       async_scheduling=True)
    return build_core(cfg)[0]


def drain(core) -> None:
    while core.has_work():
        core.step()


def decode_step_ms(batch: int, steps: int, repeats: int) -> tuple[float, list[float]]:
    """(min of the medians, the medians) of a full-batch decode step's host time."""
    core = new_core(batch * 200 + 64, batch)
    gen = torch.Generator().manual_seed(0)
    core.runner.execute = lambda sched, table_of, token_mask=None: StepResult(
        torch.randint(3, 200, (len(sched.samples), 1), generator=gen), None, None)
    params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)  # under max_model_len
    for i in range(batch):
        prompt = [5 + (i * 7 + j) % 200 for j in range(PROMPT_LEN)]
        core.add_request(EngineRequest(f"r{i}", prompt, params, time.monotonic()))
    while core.scheduler.waiting or any(not s.is_decode for s in core.scheduler.running):
        core.step()  # the prefills
    medians = []
    for _ in range(repeats):
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t)
        medians.append(statistics.median(times) * 1e3)
    return min(medians), medians


def prefix_hit_ms(rounds: int) -> tuple[float, dict[str, float]]:
    """(median ms of the two steps, mean ms per phase) over `rounds` prefix-hit steps."""
    core = new_core(4096, 256)
    hidden = core.runner.model.config.hidden_size
    core.runner._forward = lambda ids, pos, meta, out_rows=None: torch.zeros(
        ids.shape[0] if out_rows is None else out_rows.shape[0], hidden)
    phases: dict[str, float] = collections.defaultdict(float)
    measuring = [False]

    def timed(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if measuring[0]:
                phases[key] += (time.perf_counter() - t) * 1e3
            return out

        setattr(obj, name, wrapper)

    for obj, name, key in ((core.scheduler, "schedule", "schedule"), (core.kv, "allocate", "allocate"),
                           (core.runner, "execute", "execute"), (core.runner, "_pack", "execute: pack"),
                           (core.runner.packer, "send", "execute: send"), (core, "_postprocess", "post")):
        timed(obj, name, key)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prefix = [5 + (j * 13) % 200 for j in range(496)]

    def one_round(k: int) -> float:
        core.add_request(EngineRequest(f"p{k}", prefix + [7] * 16, params, time.monotonic()))
        drain(core)  # the prefix is computed and cached
        for i in range(32):
            tail = [(k * 100 + i * 16 + j) % 200 + 3 for j in range(16)]
            core.add_request(EngineRequest(f"r{k}-{i}", prefix + tail, params, time.monotonic()))
        hits = core.kv.usage().prefix_hits
        measuring[0] = True
        t = time.perf_counter()
        core.step()
        core.step()
        dt = time.perf_counter() - t
        measuring[0] = False
        if core.kv.usage().prefix_hits - hits != 32 * len(prefix):
            raise RuntimeError("the prefix-hit step did not find its 32 prefixes in the cache")
        drain(core)
        return dt * 1e3

    for k in range(5):
        one_round(k)
    phases.clear()
    times = [one_round(k) for k in range(5, 5 + rounds)]
    return statistics.median(times), {key: v / rounds for key, v in phases.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefix-rounds", type=int, default=60)
    args = ap.parse_args()
    print("| case | host ms | per sequence us |\n|---|---|---|")
    for batch in args.batches:
        ms, _ = decode_step_ms(batch, args.steps, args.repeats)
        print(f"| decode step, batch {batch} | {ms:.3f} | {ms / batch * 1e3:.2f} |", flush=True)
    ms, phases = prefix_hit_ms(args.prefix_rounds)
    print(f"| prefix-hit step + its post (forward stubbed) | {ms:.3f} | {ms / 32 * 1e3:.1f} |")
    print("  phases (ms a round): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items())))


if __name__ == "__main__":
    main()
