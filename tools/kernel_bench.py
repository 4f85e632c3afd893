"""Paged-decode benchmark (not a test): `python -m kernels.benchmark [--out DIR] [--sweep]`.

Llama-style decode, Hq=32, Hkv=8, D=128, bf16, block_size 16 over seven (batch, context) shapes, plus block
sizes 1 and 128 at (64, 8192). In one run, timed with triton.testing.do_bench (median; it clears the L2
before every call, so each call reads its KV from HBM): ours (the heuristic's pick, and with --sweep the
best of several tile configs and split counts); torch SDPA on the same data laid out contiguously
(enable_gqa); gather-through-the-block-table then SDPA; the torch reference. Effective bandwidth counts the
KV bytes read once; copy bandwidth is a device-to-device copy in the same run (bytes read + written).
Writes kernel_<gpu>.json / .png / .md under --out (default docs/benchmarks).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from kernels import DecodeWorkspace, l2_hint, paged_decode_attention, reference
from kernels.paged_decode import paged_decode_attention_triton
from kernels.split_heuristic import KernelConfig, choose_launch, cp_async_hint, num_sms
from tests.kernel_cases import make_paged_case, rel_error

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
SHAPES = [(1, 4096), (1, 32768), (16, 4096), (64, 2048), (64, 8192), (128, 4096), (256, 1024)]
EXTRA_BLOCK_SIZES = [(64, 8192, 1), (64, 8192, 128)]
SWEEP_CONFIGS = [KernelConfig(64, 4, 2), KernelConfig(64, 4, 3), KernelConfig(32, 4, 4),
                 KernelConfig(128, 4, 2)]
CLEAR_BYTES = 256 * 2**20
SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bench_us(fn, repeats=1) -> float:
    """do_bench median in µs; with repeats > 1, the median of that many do_bench medians (at the small shapes
    one do_bench median moves by several µs between calls with host jitter)."""
    return statistics.median(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
                             for _ in range(repeats))


def host_us(fn, n=200) -> float:
    """Host time per call, calls back to back (the GPU keeps up at small shapes, so this is launch cost)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _graph(body, n):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()                                   # warm-up / compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(n):
            body()
    return g


def _replay_ms(g, reps=10) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def gpu_cold_us(fn, n=20, clear="write") -> float:
    """GPU-only time of fn with a cold L2 and no launch gaps: graph of (clear; fn) minus graph of clear.
    clear="write" zeroes a 256 MB buffer as do_bench does, which leaves the L2 full of dirty lines that fn's
    own loads must first write back to DRAM; clear="read" sums it instead, leaving clean lines."""
    cache = torch.zeros(CLEAR_BYTES // 4, dtype=torch.int32, device="cuda")
    flush = cache.zero_ if clear == "write" else (lambda: cache.sum(dtype=torch.int64))
    with_fn = _graph(lambda: (flush(), fn()), n)
    alone = _graph(flush, n)
    return (_replay_ms(with_fn) - _replay_ms(alone)) / n * 1e3


def l2_probe(out_dir: Path) -> None:
    """How much of a cold-L2 time is the write-back of the clear's dirty lines: ours and SDPA GPU-only after a
    writing clear (do_bench's) and after a reading one. Prints a table, writes l2_probe.json."""
    rows = []
    for batch, ctx in SHAPES[:3] + [(64, 8192)]:
        shape = Shape(batch, ctx, 16)
        row = {"B": batch, "L": ctx}
        for name, fn in (("ours", shape.ours), ("sdpa", shape.sdpa_contig)):
            for clear in ("write", "read"):
                row[f"{name}_{clear}_clear_gpu_us"] = gpu_cold_us(fn, clear=clear)
        rows.append(row)
        print(f"B={batch:<4} L={ctx:<6} ours {row['ours_write_clear_gpu_us']:7.1f} -> "
              f"{row['ours_read_clear_gpu_us']:7.1f} us   SDPA {row['sdpa_write_clear_gpu_us']:7.1f} -> "
              f"{row['sdpa_read_clear_gpu_us']:7.1f} us   (writing clear -> reading clear)", flush=True)
        del shape
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            **ptxas_info()}
    (out_dir / "l2_probe.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))


def try_bench_us(fn) -> float:
    """Like bench_us, but a config the compiler rejects (e.g. too much shared memory) times as inf."""
    try:
        return bench_us(fn)
    except Exception as exc:  # noqa: BLE001 - any compile/launch failure just rules the config out
        print(f"  config failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return float("inf")


def copy_tbps() -> float:
    n = 1 << 30                                                   # 1 GiB each way
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src))
    return 2 * n / (us * 1e-6) / 1e12


def kv_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * HKV * D * torch.finfo(DTYPE).bits // 8


class Shape:
    """Paged inputs, their contiguous twin for SDPA and the callables timed for one (B, L, block_size)."""

    def __init__(self, batch, ctx, block_size, layout="token"):
        self.batch, self.ctx, self.block_size, self.layout = batch, ctx, block_size, layout
        self.case = make_paged_case([ctx] * batch, HQ, HKV, D, block_size, dtype=DTYPE, device="cuda",
                                    seed=batch + ctx, spare_blocks=1, layout=layout)
        self.q4 = self.case.q.unsqueeze(2)                                   # (B, Hq, 1, D)
        self.workspace = DecodeWorkspace(batch, HKV, "cuda")                # as the runner passes one
        self.k_contig, self.v_contig = self.gather()                        # (B, Hkv, L, D)

    def gather(self):
        c = self.case
        k = c.k_cache[c.block_tables.long()].flatten(1, 2)[:, :self.ctx]     # (B, L, Hkv, D)
        v = c.v_cache[c.block_tables.long()].flatten(1, 2)[:, :self.ctx]
        return k.transpose(1, 2), v.transpose(1, 2)

    def ours(self, num_splits=None, config=None, workspace=True):
        """The public call (kernels.paged_decode_attention: dispatch, checks, heuristic) with the caller's
        DecodeWorkspace, as the server's runner calls it; a forced split count or config goes to the Triton
        wrapper. workspace=False: no workspace, so the splits are merged by a second launch."""
        c = self.case
        ws = self.workspace if workspace else None
        if num_splits is None and config is None:
            return paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, workspace=ws)
        return paged_decode_attention_triton(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens,
                                             num_splits=num_splits, config=config, workspace=ws)

    def ours_two_launch(self):
        return self.ours(workspace=False)

    def sdpa_contig(self):
        return F.scaled_dot_product_attention(self.q4, self.k_contig, self.v_contig, enable_gqa=True)

    def gather_sdpa(self):
        k, v = self.gather()
        return F.scaled_dot_product_attention(self.q4, k, v, enable_gqa=True)

    def torch_ref(self):
        c = self.case
        return reference.paged_decode_attention_dense(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens)

    def heuristic(self):
        dev = self.case.q.device
        return choose_launch(dev, self.batch, HKV, self.case.block_tables.shape[1] * self.block_size, D,
                             self.case.q.element_size(), self.block_size, num_sms(dev), cp_async_hint(dev))


def sdpa_backend_seen(shape: Shape) -> str:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        shape.sdpa_contig()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    for tag in ("flash", "efficient", "cudnn", "math"):
        hits = sorted(n for n in names if tag in n.lower() and "attention" in n.lower())
        if hits:
            return hits[0]
    return "unknown: " + ", ".join(sorted(names))[:200]


def sweep(shape: Shape, deadline: float, configs) -> list[dict]:
    """Time tile configs at the heuristic's split count, then split counts at the best config."""
    cfg0, splits0 = shape.heuristic()
    rows = []
    for cfg in configs:
        if time.time() > deadline:
            break
        us = try_bench_us(lambda c=cfg: shape.ours(splits0, c))
        rows.append({"config": vars(cfg), "splits": splits0, "us": us})
    best_cfg = KernelConfig(**min(rows, key=lambda r: r["us"])["config"]) if rows else cfg0
    max_splits = max(1, shape.ctx // best_cfg.block_n)
    for s in SPLIT_CHOICES:
        if s != splits0 and s <= max_splits and time.time() < deadline:
            rows.append({"config": vars(best_cfg), "splits": s,
                         "us": try_bench_us(lambda s=s: shape.ours(s, best_cfg))})
    return rows


def measure_row(batch, ctx, block_size, copy, args, deadline, configs, with_ref=True) -> dict:
    shape = Shape(batch, ctx, block_size)
    ref = shape.sdpa_contig().squeeze(2).double()
    err = rel_error(shape.ours(), ref)
    if err > 1e-2:
        raise RuntimeError(f"ours disagrees with SDPA at {(batch, ctx, block_size)}: rel err {err:.2e}")
    cfg0, splits0 = shape.heuristic()
    row = {"B": batch, "L": ctx, "block_size": block_size, "rel_err_vs_sdpa": err,
           "heuristic": {"config": vars(cfg0), "splits": splits0},
           "ours_us": bench_us(shape.ours, repeats=3),
           "ours_two_launch_us": bench_us(shape.ours_two_launch, repeats=3),
           "ours_two_launch_gpu_us": gpu_cold_us(shape.ours_two_launch),
           "sdpa_contig_us": bench_us(shape.sdpa_contig, repeats=3),
           "gather_sdpa_us": bench_us(shape.gather_sdpa),
           "torch_ref_us": bench_us(shape.torch_ref) if with_ref else None,
           "ours_host_us": host_us(shape.ours), "sdpa_host_us": host_us(shape.sdpa_contig),
           "ours_gpu_us": gpu_cold_us(shape.ours), "sdpa_gpu_us": gpu_cold_us(shape.sdpa_contig)}
    if args.sweep:
        row["sweep"] = sweep(shape, deadline, configs)
        best = min(row["sweep"] + [{"us": row["ours_us"], **row["heuristic"]}], key=lambda r: r["us"])
        row["best"] = best
    nbytes = kv_bytes(batch, ctx)
    for key in ("ours", "sdpa_contig", "gather_sdpa"):
        row[f"{key}_TBps"] = nbytes / (row[f"{key}_us"] * 1e-6) / 1e12
    row["copy_TBps"] = copy
    row["ours_frac_of_copy"] = row["ours_TBps"] / copy
    del shape
    gc.collect()
    torch.cuda.empty_cache()
    return row


def peak_memory(batch=64, ctx=8192) -> list[dict]:
    """Honest peak memory of one decode call: baseline, absolute peak, above-baseline peak, live output."""
    shape = Shape(batch, ctx, 16)
    res = []
    for name, fn in (("dense_math_reference", shape.torch_ref), ("sdpa_contig", shape.sdpa_contig),
                     ("gather_sdpa", shape.gather_sdpa), ("ours", shape.ours)):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        res.append({"method": name, "baseline_MiB": base / 2**20, "peak_MiB": peak / 2**20,
                    "above_baseline_MiB": (peak - base) / 2**20,
                    "live_output_MiB": out.numel() * out.element_size() / 2**20})
        del out
    return res


def gpu_tag(name: str) -> str:
    m = re.search(r"(H100|H200|A100|L40S|L4|B200|GH200|RTX ?\d+)", name, re.I)
    return (m.group(1) if m else re.sub(r"\W+", "_", name)).lower().replace(" ", "")


def write_outputs(result: dict, out_dir: Path) -> None:
    tag = gpu_tag(result["gpu"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"kernel_{tag}.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"kernel_{tag}.md").write_text(markdown(result))
    plot(result, out_dir / f"kernel_{tag}.png")


def ptxas_info() -> dict:
    """The ptxas Triton compiles with here, and whether the split config's evict-first hint reaches the
    cp.async loads with it (kernels/l2_hint.py)."""
    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    version = l2_hint.ptxas_version_for(major * 10 + minor)
    return {"ptxas": ".".join(map(str, version)), "cp_async_l2_hint": cp_async_hint(device)}


def markdown(result: dict) -> str:
    lines = [f"# Paged-decode kernel on {result['gpu']}", "",
             f"torch {result['torch']}, triton {result['triton']}, ptxas {result.get('ptxas', '?')} "
             f"(evict-first hint on the split config's cp.async loads: "
             f"{'on' if result.get('cp_async_l2_hint') else 'off'}); "
             f"Hq={HQ}, Hkv={HKV}, D={D}, bf16; "
             f"do_bench median (L2 cleared per call; ours and SDPA: median of three do_bench medians). "
             f"ours: the public call with a DecodeWorkspace, as the server's runner makes it (splits merged "
             f"in one launch); 'no workspace': the same call without one (a second launch merges). "
             f"cfg: the heuristic's tile/warps/stages and flags (kernels.split_heuristic.FLAG_LETTERS). "
             f"GPU-only: CUDA-graph replays, L2 cleared. Copy bandwidth {result['copy_TBps']:.2f} TB/s "
             f"(read+write). SDPA backend seen: `{result['sdpa_backend']}`.", "",
             "| B | L | block | ours: cfg, splits | ours µs | ours, no workspace µs | best µs (cfg, splits) "
             "| SDPA-contig µs | gather-SDPA µs | ref µs | ours / SDPA GPU-only µs "
             "| ours TB/s | SDPA TB/s | ours / copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        best = r.get("best")
        best_s = (f"{best['us']:.1f} ({KernelConfig(**best['config']).label()}, {best['splits']})"
                  if best else "-")
        heur = r["heuristic"]
        ref_s = f"{r['torch_ref_us']:.0f}" if r["torch_ref_us"] else "-"
        lines.append(f"| {r['B']} | {r['L']} | {r['block_size']} | "
                     f"{KernelConfig(**heur['config']).label()}, {heur['splits']} | {r['ours_us']:.1f} | "
                     f"{r['ours_two_launch_us']:.1f} | {best_s} | "
                     f"{r['sdpa_contig_us']:.1f} | {r['gather_sdpa_us']:.1f} | {ref_s} | "
                     f"{r['ours_gpu_us']:.1f} / {r['sdpa_gpu_us']:.1f} | {r['ours_TBps']:.2f} | "
                     f"{r['sdpa_contig_TBps']:.2f} | {r['ours_frac_of_copy']:.2f} |")
    lines += ["", f"Geometric mean SDPA-contig / ours over the seven block-16 shapes: "
              f"{result['geomean_sdpa_over_ours']:.3f} by do_bench, "
              f"{result['geomean_sdpa_over_ours_gpu_only']:.3f} by GPU-only time", "",
              "Peak memory at (64, 8192):", "",
              "| method | baseline MiB | peak MiB | above baseline MiB | live output MiB |",
              "|---|---|---|---|---|"]
    for m in result["memory"]:
        lines.append(f"| {m['method']} | {m['baseline_MiB']:.0f} | {m['peak_MiB']:.0f} | "
                     f"{m['above_baseline_MiB']:.1f} | {m['live_output_MiB']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    labels = [f"{r['B']}x{r['L']}\nbs{r['block_size']}" for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.5))
    for i, (key, name) in enumerate((("ours", "ours (Triton, paged)"), ("sdpa_contig", "SDPA contiguous"),
                                     ("gather_sdpa", "gather + SDPA"))):
        ax1.bar([j + (i - 1) * 0.27 for j in x], [r[f"{key}_us"] for r in rows], 0.27, label=name)
        ax2.bar([j + (i - 1) * 0.27 for j in x], [r[f"{key}_TBps"] for r in rows], 0.27, label=name)
    ax1.set_yscale("log")
    ax1.set_ylabel("µs (median)")
    ax2.axhline(result["copy_TBps"], color="k", ls="--", lw=1, label="D2D copy")
    ax2.set_ylabel("effective TB/s (KV bytes / time)")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.legend(fontsize=7)
    fig.suptitle(f"paged decode, {result['gpu']}, bf16 Hq32/Hkv8/D128")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(result: dict) -> str:
    out = ["B     L      bs  ours_us  no_ws    best_us  sdpa_us  gather_us  ours_TB/s  gpu-only ours/sdpa  "
           "host ours/sdpa  heur(cfg,splits) -> best"]
    for r in result["rows"]:
        b = r.get("best") or {"us": float("nan"), "config": {}, "splits": "-"}
        h = r["heuristic"]
        out.append(f"{r['B']:<5} {r['L']:<6} {r['block_size']:<3} {r['ours_us']:8.1f} "
                   f"{r['ours_two_launch_us']:8.1f} {b['us']:8.1f} "
                   f"{r['sdpa_contig_us']:8.1f} {r['gather_sdpa_us']:9.1f} {r['ours_TBps']:9.2f}  "
                   f"{r['ours_gpu_us']:8.1f}/{r['sdpa_gpu_us']:<8.1f} "
                   f"{r['ours_host_us']:6.1f}/{r['sdpa_host_us']:<6.1f} "
                   f"{KernelConfig(**h['config']).label()},{h['splits']} -> "
                   f"{KernelConfig(**b['config']).label() if b['config'] else '-'},{b['splits']}")
    out.append(f"copy {result['copy_TBps']:.2f} TB/s; "
               f"geomean SDPA/ours {result['geomean_sdpa_over_ours']:.3f} "
               f"(GPU-only {result['geomean_sdpa_over_ours_gpu_only']:.3f}); "
               f"sdpa backend {result['sdpa_backend']}")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--sweep", action="store_true", help="also time several tile configs and split counts")
    ap.add_argument("--budget-s", type=float, default=330, help="stop sweeping after this many seconds")
    ap.add_argument("--l2-probe", action="store_true",
                    help="only: GPU-only times after a writing vs a reading L2 clear (l2_probe.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels.benchmark needs a CUDA GPU")
    if args.l2_probe:
        l2_probe(Path(args.out))
        return
    t0 = time.time()
    deadline = t0 + args.budget_s
    copy = copy_tbps()
    rows, top = [], SWEEP_CONFIGS
    for batch, ctx in SHAPES:
        rows.append(measure_row(batch, ctx, 16, copy, args, deadline, SWEEP_CONFIGS))
        print(f"[{time.time() - t0:5.0f}s] B={batch} L={ctx}: ours {rows[-1]['ours_us']:.1f} us", flush=True)
    if args.sweep:  # for the other block sizes, only the best few configs of the (64, 8192) row
        ranked = sorted((r for r in rows[4]["sweep"] if r["splits"] == rows[4]["heuristic"]["splits"]),
                        key=lambda r: r["us"])
        top = [KernelConfig(**r["config"]) for r in ranked[:4]]
    for batch, ctx, bs in EXTRA_BLOCK_SIZES:
        rows.append(measure_row(batch, ctx, bs, copy, args, deadline, top, with_ref=False))
    shape = Shape(1, 4096, 16)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              **ptxas_info(), "sms": num_sms(torch.device("cuda")), "copy_TBps": copy,
              "sdpa_backend": sdpa_backend_seen(shape),
              "rows": rows, "memory": peak_memory()}
    del shape
    main_rows = [r for r in rows if r["block_size"] == 16]
    result["geomean_sdpa_over_ours"] = math.exp(
        sum(math.log(r["sdpa_contig_us"] / r["ours_us"]) for r in main_rows) / len(main_rows))
    result["geomean_sdpa_over_ours_gpu_only"] = math.exp(
        sum(math.log(r["sdpa_gpu_us"] / r["ours_gpu_us"]) for r in main_rows) / len(main_rows))
    write_outputs(result, Path(args.out))
    print(table(result))


if __name__ == "__main__":
    main()
