"""The engine core's decode step without HTTP, with and without async scheduling: \
`python -m tools.engine_step_bench`.

One EngineCore (`bench` preset on CUDA unless told otherwise), in this process. Per batch size (default
1/16/64/256) and sampling mode, `batch` requests of ~512 random prompt tokens are added and prefilled; then
full-batch decode steps are timed (the core's `step()` as the core loop calls it):
- step ms: wall time of one step() call (with async scheduling: launch of N+1 and post-processing of N);
- replay ms: device time of the decode CUDA graph (events around the replay; eager steps: 0);
- host ms: step wall minus the time blocked waiting for the device (StepResult.wait) and minus the probe's
  own replay events: schedule + pack + launch + post-processing, i.e. the CPU work per step; with async
  scheduling it overlaps the device;
- schedule / execute / postprocess ms: the host parts (execute = packing and kernel launches);
- tok/s: output tokens per second over the measured steps.
Medians over the measured steps. The prompts of a (batch, mode) are the same with and without async
scheduling, so their tokens must be too (greedy and seeded sampling): the last column checks it. Prints one
table last; writes every step's timings as JSON to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import llguidance
import torch

from server.engine import runner as runner_module
from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.sampling_params import SamplingParams
from server.heap import freeze_startup_heap

MODES = {"greedy": {"temperature": 0.0}, "sample": {"temperature": 0.8, "top_p": 0.95}}
BAD_WORDS = 16  # words of each request in a :bad_words closed loop (vLLM bounds none; pagewalk 128)


class Probe:
    """Wall clocks of the core's host phases and device events around graph replays, per step."""

    def __init__(self, core) -> None:
        self.core = core
        self.tokens: dict[str, list[int]] = {}  # request id -> tokens emitted
        self.phases: dict[str, float] = {}
        self.replays: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.wrap(core.scheduler, "schedule")
        self.wrap(core.scheduler, "postprocess")
        self.wrap(core.runner, "execute")
        wait = runner_module.StepResult.wait
        probe = self

        def timed_wait(result):
            t0 = time.perf_counter()
            try:
                return wait(result)
            finally:
                probe.phases["wait"] = probe.phases.get("wait", 0.0) + time.perf_counter() - t0

        runner_module.StepResult.wait = timed_wait
        graphs = core.runner.graphs
        if graphs is not None:
            replay = graphs.replay

            stream = core.runner.packer.stream  # the steps' stream, looked up once (as the runner does)

            def timed_replay(*args):
                t0 = time.perf_counter()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                t1 = time.perf_counter()
                out = replay(*args)
                t2 = time.perf_counter()
                end.record(stream)
                self.replays.append((start, end))
                # the events' own host time, left out of host_ms: it is the probe's, not the core's
                self.phases["probe"] = self.phases.get("probe", 0.0) + (t1 - t0) + (time.perf_counter() - t2)
                return out

            graphs.replay = timed_replay

    def wrap(self, obj, name: str) -> None:
        """Time every call of obj.name into phases[name] (seconds, summed over the step)."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)

    def step(self) -> dict:
        """One core.step() -> its timings (ms) and stats; replay times are read later (finish())."""
        self.phases = {}
        n_replays = len(self.replays)
        t0 = time.perf_counter()
        update = self.core.step()
        wall = time.perf_counter() - t0
        p = self.phases
        for u in update.updates:
            self.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
        return {"step_ms": wall * 1e3, "host_ms": (wall - p.get("wait", 0.0) - p.get("probe", 0.0)) * 1e3,
                "wait_ms": p.get("wait", 0.0) * 1e3, "schedule_ms": p.get("schedule", 0.0) * 1e3,
                "execute_ms": p.get("execute", 0.0) * 1e3, "postprocess_ms": p.get("postprocess", 0.0) * 1e3,
                "replays": list(range(n_replays, len(self.replays))),
                "decode_tokens": update.stats.num_decode_tokens,
                "prefill_tokens": update.stats.num_prefill_tokens,
                "new_tokens": sum(len(u.new_token_ids) for u in update.updates)}

    def finish(self, steps: list[dict]) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for s in steps:
            s["replay_ms"] = sum(self.replays[i][0].elapsed_time(self.replays[i][1])
                                 for i in s.pop("replays"))


def batch_prompts(core, batch: int, prompt_len: int) -> list[list[int]]:
    """The prompts of a batch size's runs: the same with and without async scheduling, in every mode."""
    gen = torch.Generator().manual_seed(batch)
    vocab = core.runner.config.vocab_size
    return [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def prime_prefix_cache(core, batch: int, prompt_len: int) -> None:
    """Prefill a batch size's prompts once (one token each), so that every measured run of them finds the
    same prefix cached: the first run would otherwise compute what the later ones read from the cache, and
    bf16 greedy tokens of the two differ, which the tokens==sync check would take for an async difference."""
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(batch_prompts(core, batch, prompt_len)):
        core.add_request(EngineRequest(f"prime-b{batch}-{i}", prompt, params, time.monotonic()))
    while core.has_work():
        core.step()


def run_batch(core, probe: Probe, batch: int, prompt_len: int, warmup: int, steps: int, mode: str,
              profiler: cProfile.Profile | None = None) -> dict:
    probe.tokens = {}
    # the prompts prefill over several steps, so the first ones decode that many steps ahead of the last
    margin = 4 + -(-batch * prompt_len // 2048)
    params = SamplingParams(max_tokens=warmup + steps + margin, ignore_eos=True, seed=1, **MODES[mode])
    for i, prompt in enumerate(batch_prompts(core, batch, prompt_len)):
        core.add_request(EngineRequest(f"b{batch}-{mode}-{i}", prompt, params, time.monotonic()))
    measured, seen = [], 0
    while core.has_work() and len(measured) < steps:
        s = probe.step()
        full = s["decode_tokens"] == batch and s["prefill_tokens"] == 0
        seen = seen + 1 if full else 0
        if full and seen > warmup:
            measured.append(s)
            if profiler is not None and len(measured) == 1:
                profiler.enable()  # the measured steps after the first
    if profiler is not None:
        profiler.disable()
    for rid in list(core.requests):
        core.abort_request(rid)
    while core.has_work():  # the step in flight, if any
        probe.step()
    probe.finish(measured)
    if len(measured) < steps:
        raise RuntimeError(f"batch {batch}: only {len(measured)} full decode steps (cache too small?)")
    med = {k: statistics.median(s[k] for s in measured) for k in
           ("step_ms", "replay_ms", "host_ms", "wait_ms", "schedule_ms", "execute_ms", "postprocess_ms")}
    total_s = sum(s["step_ms"] for s in measured) / 1e3
    # every request emitted at least warmup + steps - 1 tokens in both modes (async holds one step back)
    head = [probe.tokens.get(f"b{batch}-{mode}-{i}", [])[:warmup + steps - 1] for i in range(batch)]
    digest = hashlib.sha256(json.dumps(head).encode()).hexdigest()[:16]
    return {"batch": batch, "mode": mode, **med, "tok_s": batch * len(measured) / total_s, "tokens": digest,
            "steps": measured}


def closed_loop(core, concurrency: int, num_requests: int, prompt_len: int, output_len: int,
                cached: bool = False, sampled: bool = False, probe: Probe | None = None,
                guided: bool = False, bad_words: bool = False) -> dict:
    """The HTTP benchmark's workload without HTTP: `concurrency` requests of `prompt_len` random prompt tokens
    and `output_len` greedy output tokens (ignore_eos) kept in flight on the core, a new one added as one
    finishes, until `num_requests` finished. -> output tok/s over the whole run (prefill included).
    cached=True runs the same prompts twice and reports the second run, served from the prefix cache (as
    serving_bench's c64_cached / c256_cached), with the share of its prompt tokens found cached.
    sampled=True draws as MODES["sample"] (serving_bench's c64_sampled) instead of greedy. With the core's
    `probe`, each step of the trace carries its call's host phases (schedule, execute: the launch, wait).
    guided=True gives every request a structured output, the regex [a-z]+, with EOS biased by -100 so that
    each runs to output_len tokens as the free ones do: the token masks, the matchers on the host. (A regex
    that counts, [a-z]{128}, makes each matcher build a new lexer state every token: 7.4 ms steps at 256
    rows against 3.2 on an H100.) bad_words=True gives every request BAD_WORDS random words of one to three
    tokens: the sampler's fp32 path and its bad-words table on every step."""
    if cached:
        closed_loop(core, concurrency, num_requests, prompt_len, output_len)
    usage0 = core.kv.usage()
    vocab = core.runner.config.vocab_size
    # seeds apart from run_batch's (the batch size): a prompt seen before would hit the prefix cache
    # and a sampled run's apart from the greedy one's of the same size (its prompts would be cached)
    gen = torch.Generator().manual_seed(1_000_000 + 1_000 * concurrency + num_requests + 500_000 * sampled
                                        + 2_000_000 * guided + 3_000_000 * bad_words)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(num_requests)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True,
                            **MODES["sample" if sampled else "greedy"])
    if guided:
        params.grammar = llguidance.LLMatcher.grammar_from_regex("[a-z]+")
        params.logit_bias = {eos: -100.0 for eos in core.eos_token_ids}
    if bad_words:
        params.bad_words_ids = [torch.randint(3, vocab, (1 + i % 3,), generator=gen).tolist()
                                for i in range(BAD_WORDS)]
    added, finished, tokens = 0, 0, 0
    timeline = StepTimeline(core.async_scheduling)
    t0 = time.perf_counter()
    while finished < num_requests:
        t_add = time.perf_counter()
        while added < num_requests and added - finished < concurrency:
            request = EngineRequest(f"cl{concurrency}-{added}", prompts[added], params, time.monotonic())
            core.add_request(request)
            added += 1
        if probe is not None:
            probe.phases = {}
        t_step = time.perf_counter()
        update = core.step()
        timeline.add(t_step - t_add, time.perf_counter() - t_step, update.stats,
                     probe.phases if probe is not None else None)
        for u in update.updates:
            tokens += len(u.new_token_ids)
            finished += u.finish_reason is not None
    wall = time.perf_counter() - t0
    usage1 = core.kv.usage()
    queries = usage1.prefix_queries - usage0.prefix_queries
    return {"closed_loop": True, "concurrency": concurrency, "num_requests": num_requests,
            "prompt_len": prompt_len, "output_len": output_len, "async_scheduling": core.async_scheduling,
            "cached": cached, "sampled": sampled, "guided": guided, "bad_words": bad_words,
            "prefix_hit_rate": (usage1.prefix_hits - usage0.prefix_hits) / queries if queries else 0.0,
            "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": timeline.summary()}


class StepTimeline:
    """Where a closed loop's wall time goes: every waited step's (wall ms, prompt tokens, decode rows[,
    schedule, execute, wait ms]), and the host time spent adding requests. With async scheduling a step()
    call waits for the step launched by the call before, so its wall is charged to that step; its phases
    are the call's (schedule and execute: the launch of the next step)."""

    def __init__(self, async_scheduling: bool) -> None:
        self.async_scheduling = async_scheduling
        self.add_s = 0.0
        self._launched = None  # the stats of the step the next call waits for (async)
        self.trace: list[tuple] = []

    def add(self, add_s: float, step_s: float, stats, phases: dict[str, float] | None = None) -> None:
        self.add_s += add_s
        waited = self._launched if self.async_scheduling else stats
        self._launched = stats
        if waited is not None:
            row = (round(step_s * 1e3, 4), waited.num_prefill_tokens, waited.num_decode_tokens)
            if phases is not None:
                row += tuple(round(phases.get(k, 0.0) * 1e3, 4) for k in ("schedule", "execute", "wait"))
            self.trace.append(row)

    def summary(self) -> dict:
        """The trace, and its sums over steps with prompt tokens (prefill and mixed) and decode-only steps."""
        kinds = {}
        for wall_ms, prefill, decode, *_ in self.trace:
            k = kinds.setdefault("with_prompt_tokens" if prefill else "decode_only",
                                 {"steps": 0, "wall_s": 0.0, "prefill_tokens": 0, "decode_tokens": 0})
            k["steps"] += 1
            k["wall_s"] += wall_ms / 1e3
            k["prefill_tokens"] += prefill
            k["decode_tokens"] += decode
        return {"add_request_s": self.add_s, "kinds": kinds, "trace": self.trace}


def write_profile(core, probe: Probe, args, batch: int, mode: str, async_scheduling: bool) -> None:
    """The run again under cProfile; its top 40 functions by own time and by cumulative time as text."""
    profiler = cProfile.Profile()
    run_batch(core, probe, batch, args.prompt_len, args.warmup, args.steps, mode, profiler)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    args.cprofile.mkdir(parents=True, exist_ok=True)
    (args.cprofile / f"b{batch}_{mode}_async{int(async_scheduling)}.txt").write_text(text.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--modes", nargs="+", default=["greedy", "sample"], choices=list(MODES))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: the model's, as `pagewalk serve` (the decode tables are that wide)")
    ap.add_argument("--out", type=Path, default=Path("engine_step_bench.json"))
    ap.add_argument("--closed-loop", nargs="*", default=[], metavar="C:N[:KIND]",
                    help="also the HTTP benchmark's workload offline: C requests in flight, N in all "
                         "(--prompt-len in, --output-len out), async scheduling on; :cached runs it twice "
                         "and reports the second run, its prompts served from the prefix cache; :sampled "
                         "draws with temperature 0.8, top_p 0.95 instead of greedy; :guided gives every "
                         "request a structured output (the regex [a-z]+, EOS biased away); :bad_words "
                         f"gives each {BAD_WORDS} random bad words")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--cprofile", type=Path, default=None,
                    help="also run the measured steps again under cProfile (its timings are not reported) "
                         "and write each run's top functions under this directory")
    args = ap.parse_args()
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          max_num_seqs=max(args.batches),
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    core, info = build_core(config)
    freeze_startup_heap()  # as the engine-core process does once its core is built
    probe = Probe(core)
    for batch in args.batches:
        prime_prefix_cache(core, batch, args.prompt_len)
    results = []
    for async_scheduling in (False, True):
        core.async_scheduling = async_scheduling  # the core is idle between runs
        for mode in args.modes:
            for batch in args.batches:
                r = run_batch(core, probe, batch, args.prompt_len, args.warmup, args.steps, mode)
                if args.cprofile is not None:
                    write_profile(core, probe, args, batch, mode, async_scheduling)
                r["async_scheduling"] = async_scheduling
                results.append(r)
                print(f"async={async_scheduling} {mode} batch {batch}: step {r['step_ms']:.3f} ms, "
                      f"{r['tok_s']:.0f} tok/s", flush=True)
    loops = []
    core.async_scheduling = True
    for spec in args.closed_loop:
        c, n, *flag = spec.split(":")
        if flag not in ([], ["cached"], ["sampled"], ["guided"], ["bad_words"]):
            raise SystemExit(f"--closed-loop takes C:N or C:N:cached|sampled|guided|bad_words, got {spec!r}")
        loops.append(closed_loop(core, int(c), int(n), args.prompt_len, args.output_len,
                                 cached=flag == ["cached"], sampled=flag == ["sampled"], probe=probe,
                                 guided=flag == ["guided"], bad_words=flag == ["bad_words"]))
        print(f"closed loop {spec}: {loops[-1]['tok_s']:.0f} tok/s, prefix hits "
              f"{loops[-1]['prefix_hit_rate']:.0%}", flush=True)
    meta = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "model": info.model, "dtype": info.dtype,
            "cuda_graphs": info.cuda_graphs, "num_blocks": info.num_blocks,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results, "closed_loop": loops}, indent=1))
    cols = ("step_ms", "replay_ms", "host_ms", "schedule_ms", "execute_ms", "postprocess_ms", "tok_s")
    print(f"\n{meta['gpu']}, {info.model} {info.dtype}, prompt {args.prompt_len}, medians over {args.steps} "
          f"full-batch decode steps (ms; tok/s = output tokens per second)")
    sync_digest = {(r["mode"], r["batch"]): r["tokens"] for r in results if not r["async_scheduling"]}
    print(f"{'async':>5} {'mode':>6} {'batch':>5} " + " ".join(f"{c:>14}" for c in cols) + "  tokens==sync")
    for r in results:
        same = r["tokens"] == sync_digest[(r["mode"], r["batch"])]
        print(f"{str(r['async_scheduling']):>5} {r['mode']:>6} {r['batch']:>5} "
              + " ".join(f"{r[c]:>14.3f}" if c != "tok_s" else f"{r[c]:>14.0f}" for c in cols) + f"  {same}")
    for r in loops:
        cached = ", prompts cached" if r["cached"] else ""
        cached += ", sampled" if r.get("sampled") else ""
        print(f"closed loop: {r['concurrency']} in flight, {r['num_requests']} requests of {r['prompt_len']} "
              f"in / {r['output_len']} out{cached}: {r['tok_s']:.0f} output tok/s ({r['wall_s']:.2f} s, "
              f"prefix hits {r['prefix_hit_rate']:.0%})")
        for kind, k in r["steps"]["kinds"].items():
            print(f"  {kind}: {k['steps']} steps, {k['wall_s'] * 1e3:.1f} ms "
                  f"({k['wall_s'] * 1e3 / k['steps']:.3f} ms a step), "
                  f"{k['prefill_tokens']} prompt tokens, {k['decode_tokens']} decode tokens")
        print(f"  adding requests: {r['steps']['add_request_s'] * 1e3:.1f} ms")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
