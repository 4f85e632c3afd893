"""What a serving step does that it should not, under varied traffic: `python -m tools.step_hazards`.

One EngineCore (`bench` preset on CUDA unless told otherwise, async scheduling as served), built and warmed
up as `pagewalk serve` builds it. Then random traffic: requests of 1..--max-prompt tokens arriving every
few steps, greedy and sampled (temperature, top-p, top-k, min-p, penalties), n up to 3, some asking for
logprobs, some with logit_bias / min_tokens / allowed_token_ids, some with a structured output (a JSON schema
or a regex: their steps are post-processed before the next is planned), some aborted, for --steps steps.
Recorded:
- every Triton compile after start-up (a JIT compile stalls every stream for a fraction of a second to
  seconds): the kernel and its specialization, and the step that triggered it;
- every host-device synchronisation torch reports (torch.cuda.set_sync_debug_mode("warn")), by call site.
The event waits the core does on purpose (StepResult.wait, the step packer's buffer reuse) are CUDA-event
waits, not reported. Prints one table last; writes the details as JSON to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time
import traceback
import warnings
from pathlib import Path

import llguidance
import torch
import triton

from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.sampling_params import SamplingParams


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "greedy", "top_p", "top_k", "min_p", "penalties"])
    fields: dict = {"max_tokens": rng.randint(1, 96), "ignore_eos": rng.random() < 0.5,
                    "n": rng.choice([1, 1, 1, 2, 3]), "seed": rng.randint(0, 1000)}
    if kind != "greedy":
        fields["temperature"] = rng.choice([0.7, 1.0])
    if kind == "top_p":
        fields["top_p"] = 0.95
    if kind == "top_k":
        fields["top_k"] = 50
    if kind == "min_p":
        fields["min_p"] = 0.05
    if kind == "penalties":
        fields.update(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1)
    if rng.random() < 0.15:
        fields["logprobs"] = rng.choice([0, 5])
    if rng.random() < 0.15:  # the sampler's bias table: logit_bias, min_tokens, allowed_token_ids
        fields["logit_bias"] = {rng.randrange(1000): rng.uniform(-20, 20) for _ in range(rng.randint(1, 40))}
        fields["min_tokens"] = rng.randint(0, fields["max_tokens"])
        if rng.random() < 0.3:
            fields["allowed_token_ids"] = rng.sample(range(1000), rng.randint(1, 64))
    elif rng.random() < 0.1:  # a structured output: the token mask, steps post-processed before the next
        fields["grammar"] = rng.choice([
            llguidance.LLMatcher.grammar_from_regex(f"[a-{rng.choice('cfz')}]{{2,{rng.randint(3, 40)}}}"),
            llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object", "properties": {"k": {"type": "integer"}, "v": {"type": "string"}},
                 "required": ["k"]}, defaults={"whitespace_flexible": False})])
    return SamplingParams(**fields)


class Watch:
    def __init__(self) -> None:
        self.step = -1
        self.compiles: list[dict] = []
        self.syncs: collections.Counter[str] = collections.Counter()

    def on_compile(self, *, repr: str, **_) -> None:  # noqa: A002 (Triton's keyword)
        self.compiles.append({"step": self.step, "kernel": repr})

    def on_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/server/" in f.filename or
                  "/kernels/" in f.filename]
        site = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[::-1][:4])
        self.syncs[f"{message}: {site}"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("step_hazards.json"))
    args = ap.parse_args()
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=256,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization)
    core, info = build_core(config)
    rng = random.Random(args.seed)
    vocab = core.runner.config.vocab_size
    watch = Watch()
    triton.knobs.runtime.jit_cache_hook = watch.on_compile
    warnings.showwarning = watch.on_warning
    warnings.simplefilter("always")
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    shapes: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        watch.step = step
        if rng.random() < 0.3 or not core.has_work():
            for _ in range(rng.randint(1, 8)):
                n = rng.randint(1, args.max_prompt)
                prompt = [rng.randrange(3, vocab) for _ in range(n)]
                core.add_request(EngineRequest(f"r{step}-{rng.random()}", prompt, random_params(rng),
                                               time.monotonic()))
        if rng.random() < 0.05 and core.requests:
            core.abort_request(rng.choice(list(core.requests)))
        update = core.step()
        shapes.append((update.stats.num_decode_tokens, update.stats.num_prefill_tokens))
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    triton.knobs.runtime.jit_cache_hook = None
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "model": info.model,
              "cuda_graphs": info.cuda_graphs, "steps": args.steps, "wall_s": wall,
              "distinct_step_shapes": len(set(shapes)), "compiles": watch.compiles,
              "syncs": dict(watch.syncs.most_common())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}: {args.steps} steps of "
          f"random traffic ({result['distinct_step_shapes']} distinct (decode, prefill) token counts) "
          f"in {wall:.1f} s")
    print(f"Triton compiles after start-up: {len(watch.compiles)}")
    for c in watch.compiles[:20]:
        print(f"  step {c['step']}: {c['kernel'][:160]}")
    print(f"host-device syncs reported: {sum(watch.syncs.values())}")
    for site, n in watch.syncs.most_common(10):
        print(f"  {n:>5} x {site[:200]}")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
