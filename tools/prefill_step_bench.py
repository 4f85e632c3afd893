"""The engine core's prefill and mixed (decode + prefill chunk) steps without HTTP: \
`python -m tools.prefill_step_bench`.

One EngineCore (`bench` preset on CUDA unless told otherwise), in this process, async scheduling off so a
step()'s wall time is the step's. Two kinds of step:
- prefill: R requests of L random prompt tokens admitted together and prefilled in one step (R x L tokens);
- mixed: B requests decoding while fresh prompts of the same length (--context) prefill, P tokens a step
  (budget B + P: a chunk of one prompt when P is shorter, P / context whole prompts otherwise), so every
  measured step runs B decode tokens and P prefill tokens.
- prefix hits: C requests sharing a cached prefix of K tokens, each with N new ones, prefilled in one step
  (C chunks x N tokens, each attending to K + N keys through its block table; issue 20's 32 x 16 over 496);
  with --prefix-async also back to back under async scheduling, C such requests for every step.
Per case: wall ms of one step (median), the device's busy time (the sum of the kernels' durations, from
torch.profiler), the share of the wall the device was busy, and the dense-matmul TFLOP/s of the step
(2 x decoder weights x tokens + 2 x lm_head x sampled rows + causal attention). A busy share well under
100% means the step is host-bound (eager launches); TFLOP/s against the GPU's dense peak says how far a
compute-bound step is from the limit. Prints one table last; writes the cases and the top kernels of each as
JSON to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}


class Case:
    host_profiles: Path | None = None  # --cprofile: each case's timed steps also run under cProfile

    def __init__(self, core, name: str):
        self.core, self.name = core, name
        self.walls: list[float] = []
        self.kernels: dict[str, float] = {}  # kernel name -> device µs over the profiled steps
        self.profiled = 0
        self.host = cProfile.Profile() if self.host_profiles is not None else None

    def step(self, profiled: bool) -> object:
        if not profiled:
            if self.host is not None:
                self.host.enable()
            t0 = time.perf_counter()
            update = self.core.step()
            self.walls.append((time.perf_counter() - t0) * 1e3)
            if self.host is not None:
                self.host.disable()
            return update
        activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            update = self.core.step()
        for e in prof.key_averages():
            us = e.self_device_time_total if activity is ProfilerActivity.CUDA else 0.0
            if us > 0:
                self.kernels[e.key] = self.kernels.get(e.key, 0.0) + us
        self.profiled += 1
        return update

    def result(self, flops: float, prompt_tokens: int) -> dict:
        if self.host is not None:
            text = io.StringIO()
            pstats.Stats(self.host, stream=text).sort_stats("tottime").print_stats(40)
            self.host_profiles.mkdir(parents=True, exist_ok=True)
            name = self.name.replace(" ", "_") + f"_{'async' if self.core.async_scheduling else 'sync'}"
            (self.host_profiles / f"{name}.txt").write_text(text.getvalue())
        wall = statistics.median(self.walls)
        busy = sum(self.kernels.values()) / max(1, self.profiled) / 1e3
        top = sorted(self.kernels.items(), key=lambda kv: -kv[1])[:12]
        return {"case": self.name, "wall_ms": wall, "busy_ms": busy, "busy_share": busy / wall,
                "prompt_tokens": prompt_tokens,
                "tflops": flops / (wall / 1e3) / 1e12, "steps": len(self.walls),
                "top_kernels_us_per_step": {k: v / max(1, self.profiled) for k, v in top}}


def prompt(vocab: int, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def flops(model, tokens: int, samples: int, attn_pairs: int) -> float:
    """Dense matmul FLOPs of a step: decoder weights over every token, the lm_head over sampled rows,
    QK^T and PV over `attn_pairs` (query, key) pairs."""
    cfg = model.config
    decoder = sum(p.numel() for n, p in model.named_parameters() if "layers" in n and p.dim() == 2)
    head = cfg.vocab_size * cfg.hidden_size
    attn = 4 * cfg.num_heads * cfg.head_dim * attn_pairs * cfg.num_layers
    return 2 * decoder * tokens + 2 * head * samples + attn


def drain(core) -> None:
    for rid in list(core.requests):
        core.abort_request(rid)
    while core.has_work():
        core.step()


def prefill_case(core, requests: int, length: int, repeats: int, gen) -> dict:
    core.scheduler.max_num_batched_tokens = requests * length
    case = Case(core, f"prefill {requests}x{length}")
    vocab = core.runner.config.vocab_size
    for r in range(repeats + 2):  # two warm-ups (the first also compiles), the last one profiled
        for i in range(requests):
            core.add_request(EngineRequest(f"p{requests}x{length}-{r}-{i}", prompt(vocab, length, gen),
                                           SamplingParams(max_tokens=1, **GREEDY), time.monotonic()))
        update = case.step(profiled=r == repeats + 1)
        assert update.stats.num_prefill_tokens == requests * length, update.stats
        if r < 2:
            case.walls.clear()
        drain(core)
    pairs = requests * length * (length + 1) // 2
    return case.result(flops(core.runner.model, requests * length, requests, pairs), requests * length)


def prefix_case(core, chunks: int, new: int, cached: int, repeats: int, gen) -> dict:
    vocab = core.runner.config.vocab_size
    core.scheduler.max_num_batched_tokens = 8192
    case = Case(core, f"prefix hits {chunks}x{new} over {cached}")
    params = SamplingParams(max_tokens=1, **GREEDY)
    for r in range(repeats + 2):
        shared = prompt(vocab, cached, gen)
        core.add_request(EngineRequest(f"px{r}", shared + prompt(vocab, new, gen), params, time.monotonic()))
        first = core.step()  # the prefix is computed and registered in the cache
        assert first.stats.num_prefill_tokens == cached + new, first.stats
        drain(core)
        for i in range(chunks):
            core.add_request(EngineRequest(f"px{r}-{i}", shared + prompt(vocab, new, gen), params,
                                           time.monotonic()))
        update = case.step(profiled=r == repeats + 1)
        assert update.stats.num_prefill_tokens == chunks * new, update.stats  # the prefix came from the cache
        if r < 2:
            case.walls.clear()
        drain(core)
    pairs = chunks * new * (cached + new // 2)
    return case.result(flops(core.runner.model, chunks * new, chunks, pairs), chunks * new)


def prefix_async_case(core, chunks: int, new: int, cached: int, steps: int, gen) -> dict:
    """Steady state of prefix hits with async scheduling as served: `chunks` requests sharing a cached prefix
    of `cached` tokens arrive for every step, each with `new` tokens of its own (a shared system prompt
    under load); a step()'s wall is the interval between steps, the host work of step N+1 (prefix lookups
    included) overlapping step N on the device."""
    vocab = core.runner.config.vocab_size
    core.scheduler.max_num_batched_tokens = 8192
    params = SamplingParams(max_tokens=1, **GREEDY)
    shared = prompt(vocab, cached, gen)
    core.add_request(EngineRequest("pa", shared + prompt(vocab, new, gen), params, time.monotonic()))
    core.step()  # the prefix is computed and registered in the cache
    drain(core)
    core.scheduler.max_num_batched_tokens = chunks * new
    core.async_scheduling = True
    case = Case(core, f"prefix hits {chunks}x{new} over {cached} (async)")
    for i in range((steps + 4) * chunks):
        core.add_request(EngineRequest(f"pa-{i}", shared + prompt(vocab, new, gen), params, time.monotonic()))
    for i in range(steps + 2):
        update = case.step(profiled=i == steps + 1)
        assert update.stats.num_prefill_tokens == chunks * new, update.stats  # the prefix came from the cache
        if i == 0:
            case.walls.clear()  # the first step has no step before it to overlap
    drain(core)
    core.async_scheduling = False  # switched only while the core is idle
    pairs = chunks * new * (cached + new // 2)
    return case.result(flops(core.runner.model, chunks * new, chunks, pairs), chunks * new)


def mixed_case(core, batch: int, chunk: int, ctx: int, steps: int, gen, async_scheduling: bool) -> dict:
    """Steady state: every step decodes `batch` rows and prefills `chunk` prompt tokens; with async
    scheduling a step()'s wall is the interval between steps (the host work of step N+1 overlaps step N)."""
    vocab = core.runner.config.vocab_size
    core.scheduler.max_num_batched_tokens = 8192
    params = SamplingParams(max_tokens=10_000, **GREEDY)
    for i in range(batch):
        core.add_request(EngineRequest(f"d{batch}-{chunk}-{i}", prompt(vocab, ctx, gen), params,
                                       time.monotonic()))
    while core.step().stats.num_decode_tokens < batch:  # until every one decodes
        pass
    core.scheduler.max_num_batched_tokens = batch + chunk
    name = f"mixed {batch} decode + {chunk} prefill" if chunk else f"decode {batch}"
    case = Case(core, name + (" (async)" if async_scheduling else ""))
    core.async_scheduling = async_scheduling
    for j in range(-(-(steps + 3) * chunk // ctx) + 1 if chunk else 0):  # more prompt tokens than needed
        core.add_request(EngineRequest(f"new{batch}-{chunk}-{j}", prompt(vocab, ctx, gen),
                                       SamplingParams(max_tokens=1, **GREEDY), time.monotonic()))
    for i in range(steps + 2):
        update = case.step(profiled=i == steps + 1)
        s = update.stats
        assert (s.num_decode_tokens, s.num_prefill_tokens) == (batch, chunk), s
        if i == 0:
            case.walls.clear()  # the first chunk (admission) warms up
    drain(core)
    core.async_scheduling = False  # switched only while the core is idle
    # a prompt token attends to ~ctx / 2 keys on average (its own prompt's), a decode token to ~ctx
    pairs = chunk * ctx // 2 + batch * ctx
    return case.result(flops(core.runner.model, batch + chunk, batch, pairs), chunk)


def run_mode(args, enforce_eager: bool) -> tuple[list[dict], object]:
    """Every case on one EngineCore, built and freed here (two cores at --gpu-memory-utilization would not
    fit together)."""
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=512,
                          max_num_batched_tokens=8192, gpu_memory_utilization=args.gpu_memory_utilization,
                          enforce_eager=enforce_eager)
    core, info = build_core(config)
    core.async_scheduling = False
    gen = torch.Generator().manual_seed(0)
    results = []
    for spec in filter(None, args.prefills.split(",")):  # "" runs none
        r, length = map(int, spec.split("x"))
        results.append(prefill_case(core, r, length, args.repeats, gen))
        print(results[-1]["case"], f"{results[-1]['wall_ms']:.2f} ms", flush=True)
    for spec in filter(None, args.prefix_hits.split(",")):
        c, n, k = map(int, spec.split("x"))
        results.append(prefix_case(core, c, n, k, args.repeats, gen))
        print(results[-1]["case"], f"{results[-1]['wall_ms']:.2f} ms", flush=True)
        if args.prefix_async:
            results.append(prefix_async_case(core, c, n, k, args.repeats, gen))
            print(results[-1]["case"], f"{results[-1]['wall_ms']:.2f} ms", flush=True)
    for async_scheduling in sorted({False, args.mixed_async}):
        for chunk in args.chunks:
            results.append(mixed_case(core, args.decode_batch, chunk, args.context, args.repeats, gen,
                                      async_scheduling))
            print(results[-1]["case"], f"{results[-1]['wall_ms']:.2f} ms", flush=True)
    del core
    gc.collect()
    return results, info


def prompt_rates(results: list[dict], decode_batch: int) -> None:
    """Prompt tokens per second of each step with prefill; for mixed steps also the marginal rate (prompt
    tokens over the wall beyond a decode-only step of the same batch and scheduling), against the largest
    pure prefill."""
    decode = {r["case"].endswith("(async)"): r["wall_ms"] for r in results
              if r["case"].startswith(f"decode {decode_batch}")}
    pure = [r for r in results if r["case"].startswith("prefill ")]
    best = max((r["prompt_tokens"] / r["wall_ms"] for r in pure), default=None)
    for r in results:
        r["prompt_tok_s"] = r["prompt_tokens"] / r["wall_ms"] * 1e3
        base = decode.get(r["case"].endswith("(async)"))
        if r["case"].startswith("mixed") and base is not None and r["wall_ms"] > base:
            r["marginal_prompt_tok_s"] = r["prompt_tokens"] / (r["wall_ms"] - base) * 1e3
        if best:
            r["of_pure_prefill"] = r.get("marginal_prompt_tok_s", r["prompt_tok_s"]) / (best * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefills", default="1x512,4x512,16x512", help="RxL list (\"\": none)")
    ap.add_argument("--prefix-hits", default="32x16x496", help="CxNxK list: C chunks of N new tokens over "
                    "a cached prefix of K (\"\": none)")
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 128, 256, 512, 1024, 2048],
                    help="prefill tokens of the mixed steps; 0: a decode-only step (the marginal rate's "
                    "base)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="graphs,eager", help="graphs: CUDA graphs as served; eager: "
                    "--enforce-eager (the baseline, timed in the same run)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--mixed-async", action="store_true", help="also run the mixed cases with async "
                    "scheduling as served (steady-state interval between steps)")
    ap.add_argument("--prefix-async", action="store_true", help="also run the prefix hits back to back "
                    "with async scheduling as served (steady-state interval between steps)")
    ap.add_argument("--cprofile", type=Path, default=None, help="run each case's timed steps under "
                    "cProfile (slower walls) and write its top functions under this directory")
    ap.add_argument("--out", type=Path, default=Path("prefill_step_bench.json"))
    args = ap.parse_args()
    Case.host_profiles = args.cprofile
    results, info = [], None
    for mode in args.modes.split(","):
        rows, info = run_mode(args, mode == "eager")
        prompt_rates(rows, args.decode_batch)
        results += [r | {"mode": mode} for r in rows]
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    meta = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "model": info.model, "dtype": info.dtype,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\n{meta['gpu']}, torch {meta['torch']}, {info.model} {info.dtype}; medians over "
          f"{args.repeats} steps; 'of pure': prompt rate (marginal for mixed steps) / best pure prefill")
    print(f"{'mode':>6} {'case':>32} {'wall ms':>9} {'busy ms':>9} {'busy':>6} {'TFLOP/s':>8} {'of pure':>8}")
    for r in results:
        share = f"{r['of_pure_prefill']:.0%}" if "of_pure_prefill" in r and r["prompt_tokens"] else ""
        print(f"{r['mode']:>6} {r['case']:>32} {r['wall_ms']:>9.3f} {r['busy_ms']:>9.3f} "
              f"{r['busy_share']:>6.0%} {r['tflops']:>8.1f} {share:>8}")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
