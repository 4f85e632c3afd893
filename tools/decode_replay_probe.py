"""Why a decode graph replays slower in a served runner: `python -m tools.decode_replay_probe` (GPU).

Two runners over the same model and cached K/V in one process, built in this order: D, decode graphs only;
S, as served (mixed graphs captured first, then decode graphs, one pool). Per batch: D's replay, S's replay,
D's replay again after S exists, D after 2 s of large GEMMs (clocks), and a per-kernel profile of one replay
of each at --profile-batches. Prints a table; writes decode_replay_probe.json under --out.

Found on an H200 (2026-12-01): D fresh replays 1039 us at batch 1, S 1102, and D after S 1103 too, with the
same kernels and per-kernel times in both: the slowdown is the card's state, not the graphs. nvidia-smi read
SM 1980 MHz at 105 W before, 1755 MHz at 684 W after the decode replays and 1470 MHz after 2 s of GEMMs
(power-capped clocks); the decode step's ~190 short kernels run at the SM clock.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from server.engine.runner import ModelRunner
from server.model import load_model
from tests.runner_chunks import run_chunks
from tools.decode_forward_bench import Contexts, copy_bandwidth, cuda_ms


def clocks() -> str:
    try:
        query = "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw"
        return subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return repr(e)


def decode_only(self: ModelRunner) -> None:
    decode = self._decode_graphs(use_cuda_graphs=True)
    decode.capture(torch.cuda.graph_pool_handle())
    self.graphs, self.mixed_graphs = decode, None


def build(model, ctx: Contexts, only_decode: bool, max_batch: int) -> ModelRunner:
    original = ModelRunner._capture_graphs
    if only_decode:
        ModelRunner._capture_graphs = decode_only
    try:
        return ModelRunner(model, block_size=16, num_blocks=ctx.num_blocks, max_num_seqs=max_batch,
                           max_num_batched_tokens=8192)
    finally:
        ModelRunner._capture_graphs = original


def replay_fn(runner: ModelRunner, batch: int):
    graph = runner.graphs.graphs[runner.graphs.padded_size(batch)]
    return graph.replay


def profile(fn, steps: int = 5) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_ctx
    fn()
    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows: dict[str, list[float]] = {}
    for e in events:
        rows.setdefault(e.name[:80], []).append(e.device_time_total if hasattr(e, "device_time_total")
                                                  else e.cuda_time_total)
    kernels = sorted(((n, sum(v) / steps, len(v) // steps) for n, v in rows.items()), key=lambda r: -r[1])
    starts = sorted((e.time_range.start, e.time_range.end) for e in events)
    span = (starts[-1][1] - starts[0][0]) / steps if starts else 0.0
    return {"kernel_sum_us": sum(k[1] for k in kernels), "span_us_per_step": span,
            "kernels": [{"name": n, "us": us, "calls": c} for n, us, c in kernels]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--profile-batches", default="1,64,256")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    result: dict = {"copy_tb_s": copy_bandwidth() / 1e12, "clocks": {"start": clocks()}}
    model, _ = load_model("bench", "cuda", torch.bfloat16)
    ctx = Contexts(max(batches), 576, 16)
    d = build(model, ctx, True, max(batches))
    d.kv.data.normal_()
    for b in batches:
        run_chunks(d, ctx.chunks(b))
    times: dict[str, dict[int, float]] = {"D fresh": {}}
    for b in batches:
        times["D fresh"][b] = cuda_ms(replay_fn(d, b), 200) * 1e3
    result["clocks"]["after D"] = clocks()
    s = build(model, ctx, False, max(batches))
    s.kv.data.copy_(d.kv.data)
    for b in batches:
        run_chunks(s, ctx.chunks(b))
    for name, runner in (("S", s), ("D after S", d)):
        times[name] = {b: cuda_ms(replay_fn(runner, b), 200) * 1e3 for b in batches}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    result["clocks"]["after GEMMs"] = clocks()
    times["D after GEMMs"] = {b: cuda_ms(replay_fn(d, b), 200) * 1e3 for b in batches}
    times["S after GEMMs"] = {b: cuda_ms(replay_fn(s, b), 200) * 1e3 for b in batches}
    result["times_us"] = times
    result["profiles"] = {}
    for b in [int(x) for x in args.profile_batches.split(",")]:
        result["profiles"][b] = {"D": profile(replay_fn(d, b)), "S": profile(replay_fn(s, b))}
    result["graph_sizes"] = {"D": d.graphs.sizes, "S_decode": s.graphs.sizes,
                             "S_mixed": s.mixed_graphs.sizes}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_replay_probe.json").write_text(json.dumps(result, indent=1))
    for b, p in result["profiles"].items():
        print(f"\nbatch {b}: per-kernel us (D vs S)")
        names = {k["name"] for k in p["D"]["kernels"]} | {k["name"] for k in p["S"]["kernels"]}
        dk = {k["name"]: k for k in p["D"]["kernels"]}
        sk = {k["name"]: k for k in p["S"]["kernels"]}
        for n in sorted(names, key=lambda n: -(dk.get(n, sk.get(n))["us"])):
            x, y = dk.get(n, {"us": 0, "calls": 0}), sk.get(n, {"us": 0, "calls": 0})
            print(f"  {x['us']:8.1f} x{x['calls']:<3d} {y['us']:8.1f} x{y['calls']:<3d} {n}")
        print(f"  sum D {p['D']['kernel_sum_us']:.1f} span {p['D']['span_us_per_step']:.1f}; "
              f"sum S {p['S']['kernel_sum_us']:.1f} span {p['S']['span_us_per_step']:.1f}")
    print("\n", json.dumps(result["clocks"], indent=1))
    print(f"{'case':>16} " + " ".join(f"{b:>8}" for b in batches))
    for name, row in times.items():
        print(f"{name:>16} " + " ".join(f"{row[b]:8.1f}" for b in batches))


if __name__ == "__main__":
    main()
