"""Greedy argmax benchmark (GPU, not a test): `python -m tools.argmax_bench [--out DIR_OR_JSON]`.

The greedy decode step's token ids from (S, V) logits at V = 128256 (the bench model's vocabulary) in bf16
(the decode graph's output, what the runner reads) and fp32 (a prefill or penalised step's), S in
{1, 16, 64, 256}: torch.argmax(dim=-1) against kernels/argmax.py's argmax_rows. Device µs per call: CALLS
back-to-back calls captured in one CUDA graph, replayed and timed with CUDA events (pure device time, no
launch gaps), and the bandwidth that makes of the S * V logits read once; host µs per eager call (HOST_CALLS
calls back to back, no synchronisation: what a step's Python pays to launch it). Every call's ids are checked
equal to torch.argmax's; a difference exits non-zero. Prints a table last; writes JSON to --out (a .json
path, or a directory that gets argmax_<gpu>.json). `--dry-run` runs on CPU at V = 300 under
TRITON_INTERPRET=1 (no timing): a check of the tool, not a measurement.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kernels import argmax as argmax_mod
from kernels.argmax import argmax_rows, num_chunks
from tools.sampler_bench import graph_ms, out_path

V_BENCH = 128256
BATCHES = (1, 16, 64, 256)
CALLS = 20  # argmaxes per captured graph: one replay's launch overhead spread over them
HOST_CALLS = 50  # eager calls per round of the host timing: their device work (<= 50 x 46 µs) queues behind
PATHS = {"torch": lambda logits: logits.argmax(dim=-1), "kernel": argmax_rows}
SWEEP = {"BLOCK": (2048, 4096, 8192), "NUM_WARPS": (4, 8), "TARGET_PROGRAMS": (512, 1024, 2048)}


def graph_us(fn, logits: torch.Tensor, iters: int) -> float:
    """Device µs per call of fn(logits), CALLS calls captured in one CUDA graph."""
    return graph_ms(lambda: [fn(logits) for _ in range(CALLS)], iters) * 1e3 / CALLS


def host_us(fn, logits: torch.Tensor, iters: int) -> float:
    """Host µs per eager call: `iters` calls back to back with no synchronisation in between (the launches
    run ahead of the device: the wall is their host work), the median of 5 rounds."""
    fn(logits)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(logits)
        rounds.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def bench(S: int, dtype: torch.dtype, V: int, device: torch.device, args) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(S)
    logits = (torch.randn(S, V, generator=gen, device=device) * 3).to(dtype)  # (S, V)
    want = logits.argmax(dim=-1)
    rows = []
    for path, fn in PATHS.items():
        out = {"S": S, "dtype": str(dtype).removeprefix("torch."), "path": path,
               "mismatches": int((fn(logits) != want).sum()), "us": None, "gb_s": None, "host_us": None}
        if device.type == "cuda":
            out["us"] = graph_us(fn, logits, args.iters)
            out["host_us"] = host_us(fn, logits, HOST_CALLS)
            out["gb_s"] = logits.numel() * logits.element_size() / out["us"] / 1e3
        rows.append(out)
    rows[-1]["chunks_per_row"] = num_chunks(S, V)
    return rows


def sweep(batches: list[int], V: int, dtype: torch.dtype, device: torch.device, args) -> list[dict]:
    """The kernel's µs per call on `dtype` logits at each (BLOCK, NUM_WARPS, TARGET_PROGRAMS) of SWEEP, the
    module's settings patched for the call (ids checked as above)."""
    shipped = {name: getattr(argmax_mod, name) for name in SWEEP}
    rows = []
    try:
        for values in itertools.product(*SWEEP.values()):
            setting = dict(zip(SWEEP, values, strict=True))
            for name, value in setting.items():
                setattr(argmax_mod, name, value)
            for S in batches:
                rows += [{**setting, **r} for r in bench(S, dtype, V, device, args) if r["path"] == "kernel"]
    finally:
        for name, value in shipped.items():
            setattr(argmax_mod, name, value)
    return rows


def sweep_table(rows: list[dict]) -> str:
    """µs per (config, S), the shipped config marked *."""
    batches = sorted({r["S"] for r in rows})
    lines = [f"{rows[0]['dtype']} kernel µs per call: BLOCK / warps / target programs, by rows",
             f"{'config':<18}" + "".join(f"{S:>8}" for S in batches)]
    shipped = (argmax_mod.BLOCK, argmax_mod.NUM_WARPS, argmax_mod.TARGET_PROGRAMS)
    for cfg in dict.fromkeys((r["BLOCK"], r["NUM_WARPS"], r["TARGET_PROGRAMS"]) for r in rows):
        us = {r["S"]: r["us"] or 0 for r in rows if (r["BLOCK"], r["NUM_WARPS"], r["TARGET_PROGRAMS"]) == cfg}
        mark = "*" if cfg == shipped else " "
        lines.append(f"{mark}{'/'.join(map(str, cfg)):<17}" + "".join(f"{us[S]:>8.1f}" for S in batches))
    return "\n".join(lines)


def run(args) -> dict:
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        sys.exit("argmax_bench: no CUDA device (use --dry-run for the CPU check of the tool)")
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("argmax_bench --dry-run: set TRITON_INTERPRET=1 (the kernel runs on CPU in the interpreter)")
    device = torch.device("cuda" if cuda else "cpu")
    V, batches = (V_BENCH, args.batches) if cuda else (300, [1, 4])
    dtypes = (torch.bfloat16, torch.float32) if cuda else (torch.float16, torch.float32)
    results = [r for S in batches for dtype in dtypes for r in bench(S, dtype, V, device, args)]
    swept = sweep(batches, V, dtypes[0], device, args) if args.sweep else []
    versions = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    return {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "V": V, "calls": CALLS,
            "iters": args.iters, **versions, "results": results, "sweep": swept}


def table(report: dict) -> str:
    """Per (S, dtype): each path's device µs per call and GB/s, and torch / kernel."""
    by = {(r["S"], r["dtype"], r["path"]): r for r in report["results"]}
    lines = [f"V={report['V']} {report['device']} torch {report['torch']} triton {report['triton']}: "
             "device µs per argmax (GB/s of logits read) / host µs per eager call",
             f"{'S':>4} {'dtype':<9} {'torch':>22} {'kernel':>22} {'torch/kernel':>12}"]
    fmt = lambda r: f"{r['us'] or 0:.1f} ({r['gb_s'] or 0:.0f}) / {r['host_us'] or 0:.1f}"  # noqa: E731
    for S, dtype, _ in [k for k in by if k[2] == "torch"]:
        t, k = by[(S, dtype, "torch")], by[(S, dtype, "kernel")]
        ratio = t["us"] / k["us"] if k["us"] else float("nan")
        lines.append(f"{S:>4} {dtype:<9} {fmt(t):>22} {fmt(k):>22} {ratio:>12.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"),
                    help="a .json path, or a directory that gets argmax_<gpu>.json")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=list(BATCHES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the kernel's settings in SWEEP (bf16; fp16 in a dry run)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, V=300, interpreter: checks the tool only")
    args = ap.parse_args(argv)
    report = run(args)
    path = out_path(args.out, report["device"], stem="argmax")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    if report["sweep"]:
        print(sweep_table(report["sweep"]))
    print(table(report))
    bad = [r for r in report["results"] + report["sweep"] if r["mismatches"]]
    if bad:
        sys.exit(f"argmax_bench: ids other than torch.argmax's: {bad}")


if __name__ == "__main__":
    main()
