"""Paged-decode benchmark (not a test): `python -m tools.kernel_bench [--out DIR] [--label NAME]`.

Llama-style decode, Hq=32, Hkv=8, D=128, bf16, block_size 16 over seven (batch, context) shapes, plus block
sizes 1 and 128 at (64, 8192). In one run, timed with triton.testing.do_bench (median of three do_bench
medians; it clears the L2 before every call, so each call reads its KV from HBM): ours through the public
call `kernels.paged_decode_attention` with a DecodeWorkspace, as the server's runner makes it; torch SDPA on
the same data laid out contiguously (enable_gqa); gather-through-the-block-table then SDPA. GPU-only time:
CUDA-graph replays with the L2 cleared. Host time per call: back-to-back calls, through the direct launcher
and through Triton's public launch path. Copy bandwidth: a device-to-device copy in the same run.

It uses only the public kernel API, so the same script times an older checkout of kernels/ (PYTHONPATH) for a
before/after comparison: `--label before` / `--label after` write kernel_<gpu>_<label>.json under --out, and
`--compare BEFORE.json AFTER.json` writes kernel_<gpu>.{json,md,png} with both and prints the table.
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

import kernels
from tests.kernel_cases import make_paged_case, rel_error

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
SHAPES = [(1, 4096, 16), (1, 32768, 16), (16, 4096, 16), (64, 2048, 16), (64, 8192, 16), (128, 4096, 16),
          (256, 1024, 16), (64, 8192, 1), (64, 8192, 128)]
CLEAR_BYTES = 256 * 2**20


def bench_us(fn, repeats=3) -> float:
    """Median of `repeats` do_bench medians, µs (one median moves by several µs at small shapes)."""
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


def graph_us(fn, reps=10) -> float:
    """µs of one replay of a CUDA graph holding one call of fn (median over reps; L2 left as fn leaves it)."""
    return _replay_ms(_graph(fn, 1), reps) * 1e3


def gpu_cold_us(fn, n=20) -> float:
    """GPU-only time of fn with a cold L2 and no launch gaps: graph of (clear; fn) minus graph of clear."""
    cache = torch.zeros(CLEAR_BYTES // 4, dtype=torch.int32, device="cuda")
    with_fn = _graph(lambda: (cache.zero_(), fn()), n)
    alone = _graph(cache.zero_, n)
    return (_replay_ms(with_fn) - _replay_ms(alone)) / n * 1e3


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

    def __init__(self, batch, ctx, block_size):
        self.batch, self.ctx, self.block_size = batch, ctx, block_size
        self.case = make_paged_case([ctx] * batch, HQ, HKV, D, block_size, dtype=DTYPE, device="cuda",
                                    seed=batch + ctx, spare_blocks=1)
        self.q4 = self.case.q.unsqueeze(2)                                   # (B, Hq, 1, D)
        self.workspace = kernels.DecodeWorkspace(batch, HKV, "cuda")        # as the runner passes one
        self.k_contig, self.v_contig = self.gather()                        # (B, Hkv, L, D)

    def gather(self):
        c = self.case
        k = c.k_cache[c.block_tables.long()].flatten(1, 2)[:, :self.ctx]     # (B, L, Hkv, D)
        v = c.v_cache[c.block_tables.long()].flatten(1, 2)[:, :self.ctx]
        return k.transpose(1, 2), v.transpose(1, 2)

    def ours(self):
        c = self.case
        return kernels.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens,
                                              workspace=self.workspace)

    def sdpa_contig(self):
        return F.scaled_dot_product_attention(self.q4, self.k_contig, self.v_contig, enable_gqa=True)

    def gather_sdpa(self):
        k, v = self.gather()
        return F.scaled_dot_product_attention(self.q4, k, v, enable_gqa=True)


def public_launch_host_us(shape: Shape) -> float | None:
    """Host µs per call with the direct launcher off (Triton's own launch path every call); None where the
    kernels package has no direct launcher to turn off."""
    try:
        from kernels import paged_decode
        launcher = paged_decode._stage1
        launcher.direct_ok                                               # noqa: B018 - probe the attribute
    except (ImportError, AttributeError):
        return None
    launcher.direct_ok = False
    paged_decode._PLANS.clear()
    try:
        return host_us(shape.ours)
    finally:
        launcher.direct_ok = True
        paged_decode._PLANS.clear()


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
    return "unknown"


def measure_row(batch, ctx, block_size) -> dict:
    shape = Shape(batch, ctx, block_size)
    err = rel_error(shape.ours(), shape.sdpa_contig().squeeze(2).double())
    if err > 1e-2:
        raise RuntimeError(f"ours disagrees with SDPA at {(batch, ctx, block_size)}: rel err {err:.2e}")
    row = {"B": batch, "L": ctx, "block_size": block_size, "rel_err_vs_sdpa": err,
           "ours_us": bench_us(shape.ours), "sdpa_contig_us": bench_us(shape.sdpa_contig),
           "gather_sdpa_us": bench_us(shape.gather_sdpa, repeats=1),
           "ours_gpu_us": gpu_cold_us(shape.ours), "sdpa_gpu_us": gpu_cold_us(shape.sdpa_contig),
           "ours_host_us": host_us(shape.ours), "ours_public_launch_host_us": public_launch_host_us(shape),
           "sdpa_host_us": host_us(shape.sdpa_contig)}
    row["ours_TBps"] = kv_bytes(batch, ctx) / (row["ours_us"] * 1e-6) / 1e12
    del shape
    gc.collect()
    torch.cuda.empty_cache()
    return row


def geomean(rows, num_key, den_key) -> float:
    main = [r for r in rows if r["block_size"] == 16]
    return math.exp(sum(math.log(r[num_key] / r[den_key]) for r in main) / len(main))


def run(label: str) -> dict:
    copy = copy_tbps()
    rows = []
    for batch, ctx, bs in SHAPES:
        rows.append(measure_row(batch, ctx, bs))
        print(f"{label}: B={batch} L={ctx} bs={bs}: ours {rows[-1]['ours_us']:.1f} us, "
              f"SDPA {rows[-1]['sdpa_contig_us']:.1f} us", flush=True)
    return {"label": label, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_TBps": copy,
            "sdpa_backend": sdpa_backend_seen(Shape(1, 64, 16)),
            "rows": rows, "geomean_sdpa_over_ours": geomean(rows, "sdpa_contig_us", "ours_us"),
            "geomean_sdpa_over_ours_gpu_only": geomean(rows, "sdpa_gpu_us", "ours_gpu_us")}


def gpu_tag(name: str) -> str:
    m = re.search(r"(H100|H200|A100|L40S|L4|B200|GH200|RTX ?\d+)", name, re.I)
    return (m.group(1) if m else re.sub(r"\W+", "_", name)).lower().replace(" ", "")


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(before: dict, after: dict) -> str:
    lines = [f"# Paged-decode kernel on {after['gpu']}", "",
             f"torch {after['torch']}, triton {after['triton']} (its own ptxas); Hq={HQ}, Hkv={HKV}, D={D}, "
             f"bf16. `python -m tools.kernel_bench`: do_bench median of three medians, L2 cleared per call; "
             f"GPU-only: CUDA-graph replays, L2 cleared; host: back-to-back calls, direct launcher / "
             f"Triton's public launch path. Copy bandwidth {after['copy_TBps']:.2f} TB/s (read + write). "
             f"SDPA backend: `{after['sdpa_backend']}`. '{before['label']}' is the previous kernel timed in "
             f"the same run.", "",
             f"| B | L | block | ours µs | {before['label']} µs | SDPA-contig µs | gather-SDPA µs "
             f"| ours / SDPA GPU-only µs | ours TB/s | host µs direct / public | SDPA host µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, b in zip(after["rows"], before["rows"], strict=True):
        lines.append(f"| {r['B']} | {r['L']} | {r['block_size']} | {r['ours_us']:.1f} | {b['ours_us']:.1f} | "
                     f"{r['sdpa_contig_us']:.1f} | {r['gather_sdpa_us']:.1f} | "
                     f"{r['ours_gpu_us']:.1f} / {r['sdpa_gpu_us']:.1f} | {r['ours_TBps']:.2f} | "
                     f"{r['ours_host_us']:.1f} / {_fmt(r['ours_public_launch_host_us'])} | "
                     f"{r['sdpa_host_us']:.1f} |")
    lines += ["", "Geometric mean SDPA-contig / ours over the seven block-16 shapes: "
              f"**{after['geomean_sdpa_over_ours']:.3f}** by do_bench "
              f"({before['label']}: {before['geomean_sdpa_over_ours']:.3f}), "
              f"{after['geomean_sdpa_over_ours_gpu_only']:.3f} by GPU-only time "
              f"({before['label']}: {before['geomean_sdpa_over_ours_gpu_only']:.3f})."]
    return "\n".join(lines) + "\n"


def plot(after: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = after["rows"]
    labels = [f"{r['B']}x{r['L']}\nbs{r['block_size']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, (key, name) in enumerate((("ours", "ours (Triton, paged)"), ("sdpa_contig", "SDPA contiguous"),
                                     ("gather_sdpa", "gather + SDPA"))):
        tbps = [kv_bytes(r["B"], r["L"]) / (r[f"{key}_us"] * 1e-6) / 1e12 for r in rows]
        ax.bar([j + (i - 1) * 0.27 for j in x], tbps, 0.27, label=name)
    ax.axhline(after["copy_TBps"], color="k", ls="--", lw=1, label="D2D copy")
    ax.set_ylabel("effective TB/s (KV bytes / time)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.legend(fontsize=7)
    ax.set_title(f"paged decode, {after['gpu']}, bf16 Hq32/Hkv8/D128")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compare(before_path: Path, after_path: Path, out_dir: Path) -> str:
    before, after = json.loads(before_path.read_text()), json.loads(after_path.read_text())
    tag = gpu_tag(after["gpu"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"kernel_{tag}.json").write_text(json.dumps({"before": before, "after": after}, indent=1))
    md = markdown(before, after)
    (out_dir / f"kernel_{tag}.md").write_text(md)
    plot(after, out_dir / f"kernel_{tag}.png")
    return md


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--label", default="after", help="name of this kernels/ checkout in the JSON")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="render two runs' JSON")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(Path(args.compare[0]), Path(args.compare[1]), Path(args.out)))
        return
    if not torch.cuda.is_available():
        raise SystemExit("tools.kernel_bench needs a CUDA GPU")
    result = run(args.label)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernel_{gpu_tag(result['gpu'])}_{args.label}.json").write_text(json.dumps(result, indent=1))
    print(f"{args.label}: geomean SDPA/ours {result['geomean_sdpa_over_ours']:.3f} "
          f"(GPU-only {result['geomean_sdpa_over_ours_gpu_only']:.3f}), copy {result['copy_TBps']:.2f} TB/s")


if __name__ == "__main__":
    main()
