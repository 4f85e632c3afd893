"""Serving benchmark, one GPU call (not a test): `python -m tools.serving_bench --out DIR`.

What it runs, in order, each beside the memory roofline computed from the copy bandwidth measured here:
1. copy bandwidth (a 1 GiB device-to-device copy) -> roofline of a decode step at batch B with ~576-token
   contexts: (weights + KV bytes read) / bandwidth, as output tokens/s; and cuBLAS's rate at the prompt
   steps' largest product -> each level's workload bounds (tools/workload_bound.py: the prompts' FLOPs
   counted too), "serial" (prompt steps, then decode steps) and "overlap" (every byte and FLOP overlapped);
2. `pagewalk serve --model bench` (bf16, block 16, --max-num-seqs 256 --max-num-batched-tokens 8192) under
   the project's loadtest: 512 prompt / 128 output tokens, greedy, ignore_eos, streaming, concurrency
   1/16/64/256 (32 requests at 1, 256 at the others), plus sampled decoding (temperature 0.8,
   top_p 0.95) at 64; `--levels`, `--num-requests` and `--budgets` (--max-num-batched-tokens values, one
   server each; reports of a budget other than the first are named c<C>_b<budget>) widen the sweep, and
   `--long` adds each level again with 4x the requests (c<C>_long): 256 requests at concurrency 256 are one
   wave (all prefill, then all decode), the long run shows the steady state; each run has its own prompts
   (seed), and c64_cached / c256_cached repeat c64's / c256's prompts, served from the prefix cache;
   each report holds the load generator's CPU, the server's (API process, engine core) and the run's
   prefix-cache hit rate;
3. the engine without HTTP at batch 1/16/64/256 (`tools.engine_step_bench`: step time and its breakdown,
   overlap on and off), and the HTTP levels' workloads at 64 and 256 in flight run offline on the core
   (closed loop, prefill included), and the cached runs' (the same prompts again, from the prefix cache):
   the HTTP / engine ratio of the same work;
4. HF transformers `generate` with a static cache, one batch of 64, same shape (`tools.hf_baseline`).
Writes serving_<gpu>.{json,png} and serving_<gpu>_table.md (serving_h200, serving_h100, ...) under --out
(`--replot JSON` redraws them) and prints the table last. Needs the FastAPI stack, pyzmq and msgspec
importable (carried as wheels on the GPU host: tools/serving_gpu_run.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import torch

from tools.kernel_bench import gpu_tag
from tools.server_load import CpuSampler
from tools.server_wait import ServerNotHealthy, wait_healthy
from tools.workload_bound import (
    Device,
    Workload,
    kv_bytes_per_token,
    overlap_bound_tok_s,
    serial_bound_tok_s,
    weight_bytes,
)

PORT = 8011
URL = f"http://127.0.0.1:{PORT}"
IN_LEN, OUT_LEN = 512, 128
LEVELS = (1, 16, 64, 256)
HF_BATCH = 64


def copy_tbps() -> float:
    from triton.testing import do_bench
    n = 1 << 30
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * n / (ms * 1e-3) / 1e12


def gemm_tflops(tokens: int = 8192) -> float:
    """cuBLAS's bf16 rate (TFLOP/s) at the prompt steps' largest product: `tokens` rows of the bench
    preset's hidden size times its gate_up weight (2 x intermediate rows)."""
    from triton.testing import do_bench

    from server.model.config import preset
    c = preset("bench")
    x = torch.randn(tokens, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * c.intermediate_size, c.hidden_size, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: torch.nn.functional.linear(x, w), warmup=25, rep=200, return_mode="median")
    return 2 * tokens * c.hidden_size * w.shape[0] / (ms * 1e-3) / 1e12


def bounds_tok_s(res: dict, concurrency: int, num_requests: int, hit_rate: float | None = None,
                 budget: int = 8192) -> tuple[float, float] | None:
    """(serial, overlap) workload bounds of a level in output tokens/s (tools/workload_bound.py), from the
    copy bandwidth and GEMM rate measured in the run; a prefix-cache hit rate leaves that share of each
    prompt uncomputed (at least its last token runs). None for a run without a measured GEMM rate."""
    if not res.get("gemm_TFLOPs"):
        return None
    from server.model.config import preset
    cfg = preset("bench")
    computed = None if not hit_rate else max(1, round(IN_LEN * (1 - hit_rate)))
    w = Workload(num_requests, concurrency, IN_LEN, OUT_LEN, computed, budget)
    dev = Device(res["copy_TBps"] * 1e12, res["gemm_TFLOPs"] * 1e12)
    return serial_bound_tok_s(cfg, w, dev), overlap_bound_tok_s(cfg, w, dev)


def model_bytes() -> tuple[int, int]:
    """(bytes of weights one decode step reads, KV bytes per token) of the `bench` preset in bf16."""
    from server.model.config import preset
    c = preset("bench")
    return weight_bytes(c), kv_bytes_per_token(c)


def roofline_tok_s(batch: int, tbps: float, ctx: int = IN_LEN + OUT_LEN // 2) -> float:
    weights, kv_tok = model_bytes()
    step_s = (weights + batch * ctx * kv_tok) / (tbps * 1e12)
    return batch / step_s


def run(cmd: list[str], log: Path, timeout: float) -> int:
    print("$", " ".join(cmd), flush=True)
    with log.open("w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"  timed out after {timeout:.0f} s", flush=True)
            return 124


def start_server(out: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", "bench", "--device", "cuda", "--port",
           str(PORT), "--max-num-seqs", "256", *extra]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=(out / "server.log").open("w"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(URL, lambda: proc.poll() is None, 300, poll_s=1)
    except ServerNotHealthy as e:
        proc.kill()
        raise RuntimeError(f"{e} (exit code {proc.poll()}); see server.log") from None
    return proc


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9


def core_pid(log: str) -> int | None:
    """The engine core's pid, from the server's start-up line in its log text."""
    match = re.search(r"engine core process started \(pid (\d+)\)", log)
    return int(match.group(1)) if match else None


def api_server_pids(log: str) -> list[int]:
    """The API servers' pids under `--api-server-count N > 1`, from the supervisor's start-up line in the
    server's log text; [] with one API process, which is the server process itself."""
    match = re.search(r"API servers \(pids ([\d, ]+)\)", log)
    return [int(p) for p in match.group(1).split(",")] if match else []


def loadtest(out: Path, name: str, concurrency: int, num_requests: int, extra: list[str], seed: int,
             server_pid: int) -> dict | None:
    """One loadtest run; its report gains the server's CPU over the measured window (tools/server_load.py):
    "core" the engine core's, "api" the API process's, or with --api-server-count the sum of the API
    servers' (children of the supervisor) and "api_max" the busiest one's; the loadtest reports the run's
    prefix-cache hit rate itself (server_prefix_cache_hit_rate).
    Every run has its own seed: with one seed, a run's prompts would be an earlier run's, served from the
    prefix cache (the same seed gives the same first N prompts whatever the request count)."""
    path = out / f"loadtest_{name}.json"
    cmd = [sys.executable, "-m", "loadtest", "--base-url", URL, "--input-len", str(IN_LEN), "--output-len",
           str(OUT_LEN), "--num-requests", str(num_requests), "--concurrency", str(concurrency), "--warmup",
           str(min(8, concurrency)), "--seed", str(seed), "--no-progress", "--processes", "auto",
           "--out", str(path), *extra]
    sampler = CpuSampler(server_pid)
    sampler.start()
    try:
        code = run(cmd, out / f"loadtest_{name}.log", timeout=240)
    finally:
        sampler.stop()
    if code != 0 or not path.exists():
        return None
    rep = json.loads(path.read_text())
    rep.pop("requests", None)
    t0 = rep.get("start_perf_counter_s") or 0.0
    busy = sampler.busy(t0, t0 + rep.get("duration_s", 0.0))
    log = (out / "server.log").read_text()
    core = f"child {core_pid(log)}"
    # the supervisor's other children (multiprocessing's resource tracker) are neither
    names = [f"child {p}" for p in api_server_pids(log)] or ["api"]
    servers = [busy[n] for n in names if busy.get(n) is not None]
    rep["server_cpu"] = {"api": sum(servers) if servers else None, "api_max": max(servers, default=None),
                         "core": busy.get(core), "processes": busy}
    path.write_text(json.dumps(rep, indent=1))
    return rep


SAMPLED = ["--temperature", "0.8", "--top-p", "0.95"]


def serving(out: Path, levels: list[int], num_requests: int, budgets: list[int], long: bool,
            sampled: bool, api_server_counts: tuple[int, ...] = (1,)) -> dict:
    reports, health, codes = {}, {}, {}
    for budget, servers in [(b, n) for n in api_server_counts for b in budgets]:
        suffix = ("" if budget == budgets[0] else f"_b{budget}") + ("" if servers == 1 else f"_a{servers}")
        flags = ["--max-num-batched-tokens", str(budget), "--api-server-count", str(servers)]
        proc = start_server(out, flags)
        try:
            health[f"{budget}{suffix}"] = httpx.get(f"{URL}/health", timeout=5).json()
            runs = [(f"c{c}{suffix}", c, 32 if c == 1 else num_requests, []) for c in levels]
            if long:
                runs += [(f"c{c}{suffix}_long", c, 4 * num_requests, []) for c in levels if c > 1]
            if sampled and 64 in levels:
                runs.append((f"c64{suffix}_sampled", 64, num_requests, SAMPLED))
            seeds = {}
            for name, c, n, extra in sorted(runs, key=lambda r: (r[1], r[0])):   # each level's runs together
                seeds[name] = seed = 1000 * (len(reports) + 1)
                reports[name] = loadtest(out, name, c, n, extra, seed, proc.pid)
            for c in (64, 256):   # the same prompts again: served from the prefix cache (what a hit saves)
                name = f"c{c}{suffix}"
                if name in seeds:
                    reports[f"{name}_cached"] = loadtest(out, f"{name}_cached", c, num_requests, [],
                                                         seeds[name], proc.pid)
        finally:
            codes[f"{budget}{suffix}"] = stop_server(proc)
    return {"health": health, "server_exit_codes": codes, "reports": reports, "sampled_args": SAMPLED,
            "budgets": budgets, "api_server_counts": list(api_server_counts)}


def offline(out: Path) -> dict | None:
    path = out / "engine_step.json"
    if not Path("tools/engine_step_bench.py").exists():
        return None
    # the HTTP levels' workloads offline, c64_cached's / c256_cached's (the same prompts again) and
    # c64_sampled's
    loops = [f"{c}:{n}" for c in (64, 256) for n in (256, 1024)] + ["64:256:cached", "256:256:cached",
                                                                     "64:256:sampled"]
    run([sys.executable, "-m", "tools.engine_step_bench", "--out", str(path), "--closed-loop", *loops],
        out / "engine_step.log", 300)
    if not path.exists():
        return None
    res = json.loads(path.read_text())
    for row in res["results"]:
        row.pop("steps", None)                          # per-step samples: the medians are kept
    for loop in res.get("closed_loop", []):
        loop.get("steps", {}).pop("trace", None)        # per-step trace: the per-kind sums are kept
    path.write_text(json.dumps(res, indent=1))
    return res


def hf(out: Path) -> dict | None:
    path = out / "hf_b64.json"
    run([sys.executable, "-m", "tools.hf_baseline", "--model", "bench", "--device", "cuda", "--batch-size",
         str(HF_BATCH), "--input-len", str(IN_LEN), "--output-len", str(OUT_LEN), "--iters", "2", "--out",
         str(path)], out / "hf_b64.log", 300)
    return json.loads(path.read_text()) if path.exists() else None


def _pct(rep: dict | None, key: str, q: str = "p50") -> float | None:
    if not rep or not isinstance(rep.get(key), dict):
        return None
    return rep[key].get(q)


def _hit_rate(rep: dict | None) -> float | None:
    """The run's prefix-cache hit rate (the key of the JSON committed at d32df97 first: replots of it)."""
    rep = rep or {}
    return rep.get("prefix_cache_hit_rate", rep.get("server_prefix_cache_hit_rate"))


def _f(x, spec=",.0f") -> str:
    return "-" if x is None else format(x, spec)


def _bounds(bound: tuple[float, float] | None) -> str:
    return "-" if bound is None else f"{bound[0]:,.0f} / {bound[1]:,.0f}"


def table(res: dict) -> str:
    tbps = res["copy_TBps"]
    hf_tok_s = (res.get("hf") or {}).get("output_throughput")
    gemm = res.get("gemm_TFLOPs")
    lines = [f"{res['gpu']}, torch {res['torch']}, triton {res['triton']}; copy {tbps:.2f} TB/s; "
             f"cuBLAS bf16 GEMM {_f(gemm, '.0f')} TFLOP/s; "
             f"HF static generate batch {HF_BATCH}: {_f(hf_tok_s)} tok/s", "",
             "| HTTP run | out tok/s | roofline tok/s | of roofline | bound tok/s serial / overlap "
             "| of serial bound | TPOT p50 ms | TTFT p50 ms | client CPU | API CPU | core CPU "
             "| prefix hits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rep in res["serving"]["reports"].items():
        c = int(name[1:].split("_")[0])
        roof = roofline_tok_s(c, tbps)
        thr = rep.get("output_throughput") if rep else None
        cpu = (rep or {}).get("server_cpu") or {}
        n = ((rep or {}).get("config") or {}).get("num_requests")
        budget = re.search(r"_b(\d+)", name)
        bound = (bounds_tok_s(res, c, n, _hit_rate(rep),
                              int(budget.group(1)) if budget else res["serving"].get("budgets", [8192])[0])
                 if n else None)
        lines.append(f"| {name} | {_f(thr)} | {_f(roof)} | {_f(thr / roof if thr else None, '.0%')} | "
                     f"{_bounds(bound)} | {_f(thr / bound[0] if thr and bound else None, '.0%')} | "
                     f"{_f(_pct(rep, 'tpot_ms'), '.2f')} | {_f(_pct(rep, 'ttft_ms'), '.0f')} | "
                     f"{_f((rep or {}).get('client_busy_max'), '.0%')} | {_f(cpu.get('api'), '.0%')} | "
                     f"{_f(cpu.get('core'), '.0%')} | "
                     f"{_f(_hit_rate(rep), '.0%')} |")
    lines += ["", "| engine (no HTTP) | out tok/s | roofline tok/s | of roofline | step ms | replay ms "
              "| host ms |",
              "|---|---|---|---|---|---|---|"]
    for row in (res.get("engine") or {}).get("results", []):
        b = row["batch"]
        roof = roofline_tok_s(b, tbps)
        lines.append(f"| b{b} {row['mode']} async={row['async_scheduling']} | {_f(row['tok_s'])} | "
                     f"{_f(roof)} | "
                     f"{_f(row['tok_s'] / roof, '.0%')} | {_f(row['step_ms'], '.3f')} | "
                     f"{_f(row.get('replay_ms'), '.3f')} | {_f(row.get('host_ms'), '.3f')} |")
    loops = (res.get("engine") or {}).get("closed_loop", [])
    if loops:
        lines += ["", "| same workload | engine, no HTTP, tok/s | engine of serial bound | HTTP tok/s "
                  "| HTTP / engine | engine steps (with prompt tokens) | HTTP steps (with prompt tokens) "
                  "| HTTP handoff ms |",
                  "|---|---|---|---|---|---|---|---|"]
    for r in loops:
        name = (f"c{r['concurrency']}" + ("_long" if r["num_requests"] > 256 else "")
                + ("_cached" if r.get("cached") else "") + ("_sampled" if r.get("sampled") else ""))
        rep = res["serving"]["reports"].get(name) or {}
        thr = rep.get("output_throughput")
        what = (f"{r['concurrency']} in flight, {r['num_requests']} requests"
                + (", prompts cached" if r.get("cached") else "") + (", sampled" if r.get("sampled") else ""))
        kinds = (r.get("steps") or {}).get("kinds", {})
        prompt = kinds.get("with_prompt_tokens", {}).get("steps", 0)
        engine_steps = f"{prompt + kinds.get('decode_only', {}).get('steps', 0)} ({prompt})" if kinds else "-"
        http_steps = (f"{_f(rep['server_steps'])} ({_f(rep.get('server_prompt_steps'))})"
                      if rep.get("server_steps") else "-")
        # a cached loop's prompts hit as its HTTP twin's did (no twin: no bound)
        hits = _hit_rate(rep) if r.get("cached") else None
        bound = None if r.get("cached") and hits is None else bounds_tok_s(
            res, r["concurrency"], r["num_requests"], hits)
        lines.append(f"| {what} | {_f(r['tok_s'])} | {_f(r['tok_s'] / bound[0] if bound else None, '.0%')} | "
                     f"{_f(thr)} | {_f(thr / r['tok_s'] if thr else None, '.0%')} | {engine_steps} | "
                     f"{http_steps} | {_f(rep.get('server_handoff_ms'), '.2f')} |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """Output tok/s against concurrency, one line per run kind (budget, long), beside the roofline."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for name, rep in res["serving"]["reports"].items():
        if not rep or "sampled" in name or "cached" in name:
            continue
        c, _, kind = name[1:].partition("_")
        budget = kind.split("_")[0][1:] if kind.startswith("b") else str(res["serving"]["budgets"][0])
        servers = next((part[1:] for part in kind.split("_") if part.startswith("a")), "1")
        label = f"budget {budget}, {servers} API, {'4x' if kind.endswith('long') else '1x'} requests"
        series.setdefault(label, []).append((int(c), rep["output_throughput"]))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind, points in series.items():
        points.sort()
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=f"HTTP {kind}")
    levels = sorted({c for points in series.values() for c, _ in points})
    ax.plot(levels, [roofline_tok_s(c, res["copy_TBps"]) for c in levels], "k--",
            label="memory roofline of a decode step")
    if res.get("gemm_TFLOPs"):
        n = res["workload"]["num_requests"]
        ax.plot(levels, [bounds_tok_s(res, c, 32 if c == 1 else n)[0] for c in levels], "k:",
                label="workload bound, prompt steps then decode steps")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"pagewalk serve, bench preset, {IN_LEN} in / {OUT_LEN} out ({res['gpu']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/serving_bench"))
    ap.add_argument("--skip", default="", help="comma list of parts to skip: serving,engine,hf")
    ap.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    ap.add_argument("--num-requests", type=int, default=256, help="per level (32 at concurrency 1)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8192], help="--max-num-batched-tokens")
    ap.add_argument("--long", action="store_true", help="each level again with 4x the requests")
    ap.add_argument("--no-sampled", action="store_true", help="skip the sampled run at 64")
    ap.add_argument("--api-server-counts", type=int, nargs="+", default=[1],
                    help="the sweep once per --api-server-count (runs named _aN for N past the first)")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG (and table) of a saved JSON")
    args = ap.parse_args(argv)
    if args.replot:
        res = json.loads(args.replot.read_text())
        plot(res, args.replot.with_suffix(".png"))
        print(table(res))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    import triton
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_TBps": copy_tbps(), "gemm_TFLOPs": gemm_tflops(),
           "workload": {"input_len": IN_LEN, "output_len": OUT_LEN, "levels": args.levels,
                        "num_requests": args.num_requests},
           "model_bytes": dict(zip(("weights", "kv_per_token"), model_bytes(), strict=True))}
    res["serving"] = (serving(out, args.levels, args.num_requests, args.budgets, args.long,
                              not args.no_sampled, tuple(args.api_server_counts))
                      if "serving" not in skip else {"reports": {}})
    res["engine"] = offline(out) if "engine" not in skip else None
    res["hf"] = hf(out) if "hf" not in skip else None
    name = f"serving_{gpu_tag(res['gpu'])}"  # serving_h200, serving_h100, ...
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    plot(res, out / f"{name}.png")
    text = table(res)
    (out / f"{name}_table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
