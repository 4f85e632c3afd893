"""Sampler benchmark (GPU, not a test): `python -m tools.sampler_bench [--out DIR_OR_JSON]`.

One Sampler step as the runner calls it (`sampler(logits, rows, flags)`: row-parameter gathers, the draw, the
sample counters), over fp32 logits randn * 3 at V = 128256 (the bench model's vocabulary), per batch size S in
{1, 16, 64, 256}, for three paths: greedy (argmax), the torch sorted path (Sampler(kernel=False): a full-
vocabulary sort, what sampled steps ran before kernels/sampling.py) and the kernel path (Sampler(kernel=True),
with top_k <= COMPACT_TOP_K rows drawn from their best tokens as the runner does), under temperature 0.8 +
top_p 0.95 and top_k 50 + top_p 0.9. Per path: device ms per call by CUDA events over back-to-back eager
calls, device ms per replay of the call captured in a torch.cuda.CUDAGraph (pure device time), and host wall
ms per eager call with a synchronize. Every sampled token is then checked against the float64 filtered set
(kernels/sampling_reference.py); a token outside it, or greedy tokens that are not the argmax, exit non-zero.
Prints a table last; writes JSON to --out (a .json path, or a directory that gets sampler_<gpu>.json).
`--dry-run` runs the same code on CPU at V = 64 (needs TRITON_INTERPRET=1; no events, no graphs): a check of
the tool, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from kernels.sampling_reference import filtered_sets
from server.engine.sampler import Sampler, draws_from_best, row_fields, step_flags
from server.engine.sampling_params import SamplingParams
from tools.decode_forward_bench import cuda_ms

V_BENCH = 128256
BATCHES = (1, 16, 64, 256)
CONFIGS = {"t0.8_p0.95": SamplingParams(temperature=0.8, top_p=0.95),
           "k50_p0.9": SamplingParams(top_k=50, top_p=0.9)}
GREEDY = SamplingParams(temperature=0.0)


def make_sampler(params: SamplingParams, S: int, V: int, device: torch.device, kernel: bool) -> Sampler:
    """A sampler whose rows 0..S-1 hold `params` with distinct seed keys, as the runner writes them."""
    s = Sampler(S, V, device, kernel=kernel)
    fields = [row_fields(params, 1000 + r, 0) for r in range(S)]
    s.init_rows(torch.arange(S, device=device), torch.tensor([f for f, _ in fields], device=device),
                torch.tensor([i for _, i in fields], device=device))
    return s


def graph_ms(fn, iters: int) -> float:
    """Device ms per replay of one call captured in a CUDA graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return cuda_ms(graph.replay, iters)


def host_ms(fn, iters: int, sync) -> float:
    """Median wall ms of one eager call plus the synchronize that waits for it."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check_tokens(name: str, tokens: torch.Tensor, logits: torch.Tensor, params: SamplingParams) -> int:
    """Tokens outside the filtered set of `params` (greedy: tokens other than the argmax); 0 when all fit."""
    if params.greedy:
        return int((tokens != logits.argmax(-1)).sum())
    _, allowed = filtered_sets(logits, params.temperature, params.top_p, params.top_k, params.min_p)
    return int((~allowed.gather(1, tokens[:, None])).sum())


def bench_path(path: str, params: SamplingParams, logits: torch.Tensor, args, cuda: bool) -> dict:
    S, V = logits.shape
    s = make_sampler(params, S, V, logits.device, kernel=path != "sorted")
    rows, flags = torch.arange(S, device=logits.device), step_flags(params)
    # as the runner hands them: the rows that draw from their best tokens (top_k <= COMPACT_TOP_K)
    compact = rows if path == "kernel" and draws_from_best(params) else None

    def call():
        return s(logits, rows, flags, compact=compact)

    tokens = call().token_ids  # compiles the kernel outside the timing and the capture
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    out = {"path": path, "S": S, "bad_tokens": check_tokens(path, tokens, logits, params),
           "host_ms": host_ms(call, args.iters, sync)}
    out["eager_ms"] = cuda_ms(call, args.iters) if cuda else None
    out["graph_ms"] = graph_ms(call, args.iters) if cuda else None
    return out


def run(args) -> dict:
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        sys.exit("sampler_bench: no CUDA device (use --dry-run for the CPU check of the tool)")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("sampler_bench --dry-run: set TRITON_INTERPRET=1 (the kernel runs on CPU in the "
                 "interpreter)")
    device = torch.device("cuda" if cuda else "cpu")
    V, batches = (V_BENCH, args.batches) if cuda else (64, [1, 4])
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for S in batches:
        logits = torch.randn(S, V, generator=gen, device=device) * 3
        results.append({"config": "greedy", **bench_path("greedy", GREEDY, logits, args, cuda)})
        for name, params in CONFIGS.items():
            for path in ("sorted", "kernel"):
                results.append({"config": name, **bench_path(path, params, logits, args, cuda)})
    return {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "V": V,
            "torch": torch.__version__, "iters": args.iters, "results": results}


def table(report: dict) -> str:
    """Per (S, config): each path's graph-replay device ms (eager events / host wall in brackets)."""
    key = "graph_ms" if report["results"][0]["graph_ms"] is not None else "host_ms"
    by = {(r["S"], r["config"], r["path"]): r for r in report["results"]}
    lines = [f"V={report['V']} {report['device']}: ms per sampler call ({key}; eager events / host wall)",
             f"{'S':>4} {'config':<11} {'greedy':>20} {'sorted':>20} {'kernel':>20} {'kernel/greedy':>13}"]
    fmt = lambda r: f"{r[key]:.3f} ({r['eager_ms'] or 0:.3f}/{r['host_ms']:.3f})"  # noqa: E731
    for S in sorted({r["S"] for r in report["results"]}):
        g = by[(S, "greedy", "greedy")]
        for name in CONFIGS:
            srt, ker = by[(S, name, "sorted")], by[(S, name, "kernel")]
            lines.append(f"{S:>4} {name:<11} {fmt(g):>20} {fmt(srt):>20} {fmt(ker):>20} "
                         f"{ker[key] / g[key]:>13.2f}")
    return "\n".join(lines)


def out_path(out: Path, device: str, stem: str = "sampler") -> Path:
    """--out as given when a .json path, else DIR/<stem>_<gpu>.json."""
    if out.suffix == ".json":
        return out
    slug = "h200" if "H200" in device else re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    return out / f"{stem}_{slug}.json"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"),
                    help="a .json path, or a directory that gets sampler_<gpu>.json")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=list(BATCHES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dry-run", action="store_true", help="CPU, V=64, interpreter: checks the tool only")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.iters = 2
    report = run(args)
    path = out_path(args.out, report["device"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    print(table(report))
    bad = [r for r in report["results"] if r["bad_tokens"]]
    if bad:
        sys.exit(f"sampler_bench: tokens outside the filtered set: {bad}")


if __name__ == "__main__":
    main()
