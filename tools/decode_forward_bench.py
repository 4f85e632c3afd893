"""Decode-forward benchmark (GPU, not a test): `python -m tools.decode_forward_bench [--out DIR]`.

The `bench` preset (Llama-3.2-1B shape, random weights, bf16) behind five ModelRunners in one process: the
torch decoder ops (the unfused baseline), the fused Triton ops, the fused ops with a one-row step on the GEMM
route instead of the GEMVs (fused_gemm, the baseline of that route), the fused ops with the gate_up GEMM
and SiLU-and-mul as two launches (fused_silu, the baseline of kernels/gate_up_silu.py), and the fused ops
with the RoPE + K/V store kernel launched before the decode attention (fused_rope, the baseline of
kernels/new_token_rope.py's RoPE + store inside the attention launch), each with its CUDA
decode graphs captured as the server captures them (final norm and lm_head inside). Every sequence holds
--context cached tokens (random K/V in shuffled blocks) and decodes one more. Per batch size, timed with CUDA
events over back-to-back steps: one step = the graph replay plus the argmax of the real rows' model-dtype
logits, i.e. what `runner.execute` puts on the GPU for an all-greedy decode step (a sampled one reads the
graph's output in place, without a copy, in the sampling kernel). Also `runner.execute` wall time per step
(host packing and copies included, synchronised), the logits' agreement between the two ops, the achieved
bandwidth (weights + KV bytes read) / time and the fraction of the roofline, whose bandwidth is a large
device-to-device copy timed in the same run. Last, a torch.profiler split of one replayed step at each
--profile-batches size, per kernel.
Prints a table; writes decode_forward_<gpu>.{json,md} under --out.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import platform
import random
import statistics
import time
from pathlib import Path

import torch
import triton

from server.engine.runner import ModelRunner
from server.model import load_model
from tests.runner_chunks import Chunk, run_chunks
from tools.kernel_bench import gpu_tag

TARGETS_MS = {1: 0.75, 64: 1.15, 256: 2.4}  # issue 16, decode forward including logits
OPS = ("torch", "fused", "fused_gemm", "fused_silu", "fused_rope")
# the baselines of three fused routes, as functions of server/model/fused_forward.py or
# server/engine/attention.py replaced while their runner captures its graphs: fused_gemm, one row on the
# GEMM route instead of the GEMVs; fused_silu, the gate_up GEMM and SiLU-and-mul as separate launches
# instead of kernels/gate_up_silu.py's one; fused_rope, the RoPE + store kernel before the decode launch
BASELINE_ROUTES = {"fused_gemm": ("server.model.fused_forward", "takes_one_row", lambda input_ids: False),
                   "fused_silu": ("server.model.fused_forward", "fuses_gate_up_silu",
                                  lambda rows, proj: False),
                   "fused_rope": ("server.engine.attention", "ropes_in_decode_launch",
                                  lambda meta, backend: False)}
BASELINE_TITLES = {"fused_gemm": "fused, GEMM route", "fused_silu": "fused, SiLU apart",
                   "fused_rope": "fused, RoPE apart"}


def cuda_ms(fn, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean ms per call of `iters` back-to-back calls (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, read + write counted (what a memory-bound kernel moves)."""
    buffers = torch.empty(2, nbytes, dtype=torch.uint8, device="cuda")
    ms = cuda_ms(lambda: buffers[1].copy_(buffers[0]), iters=10)
    buffers = None
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def weight_bytes(model) -> int:
    """Every distinct parameter once (the tied embedding is the lm_head's read; its lookup reads B rows)."""
    seen = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def kv_bytes(cfg, seq_len: int, batch: int, dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return batch * seq_len * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


class Contexts:
    """max_batch sequences of `context` cached tokens in shuffled blocks, each decoding token `context`."""

    def __init__(self, max_batch: int, context: int, block_size: int, seed: int = 0) -> None:
        self.blocks_per_seq = -(-(context + 1) // block_size)
        self.num_blocks = max_batch * self.blocks_per_seq + 1
        rng = random.Random(seed)
        ids = list(range(1, self.num_blocks))
        rng.shuffle(ids)
        n = self.blocks_per_seq
        self.tables = [ids[i * n : (i + 1) * n] for i in range(max_batch)]
        self.tokens = [rng.randrange(3, 259) for _ in range(max_batch)]
        self.context, self.block_size = context, block_size

    def chunks(self, batch: int) -> list[Chunk]:
        t = self.context
        return [Chunk([self.tokens[i]], t, self.tables[i]) for i in range(batch)]


def build_runner(model, ops: str, ctx: Contexts, args) -> tuple[ModelRunner, dict]:
    """A runner whose graphs were captured with `ops`; -> (runner, its start-up time and graph memory)."""
    model.set_decoder_ops("fused" if ops in BASELINE_ROUTES else ops)
    module, name, baseline = BASELINE_ROUTES.get(ops, (None, None, None))
    if name:
        module = importlib.import_module(module)
        shipped = getattr(module, name)
        setattr(module, name, baseline)  # the graphs capture the baseline route
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    start = time.perf_counter()
    try:
        runner = ModelRunner(model, block_size=args.block_size, num_blocks=ctx.num_blocks,
                             max_num_seqs=max(args.batches),
                             max_num_batched_tokens=max(2048, max(args.batches)),
                             max_model_len=args.max_model_len)
    finally:
        if name:
            setattr(module, name, shipped)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    free_after, _ = torch.cuda.mem_get_info()
    if runner.graphs is None:
        raise RuntimeError(f"{ops}: CUDA graph capture failed (see the runner's warning)")
    kv = runner.kv.data.numel() * runner.kv.data.element_size()
    return runner, {"init_s": seconds, "graphs_mib": (free_before - free_after - kv) / 2**20,
                    "sizes": runner.graphs.sizes}


def graph_step(runner: ModelRunner, batch: int):
    """One greedy decode step as execute() runs it on the GPU, minus the input copies: replay, argmax."""
    graphs = runner.graphs
    size = graphs.padded_size(batch)
    graph = graphs.graphs[size]
    argmax = runner.sampler.argmax  # the engine's greedy ids: kernels/argmax.py on CUDA

    def step():
        graph.replay()
        return argmax(graphs.output[:batch])

    return step


def execute_ms(runner: ModelRunner, chunks: list[Chunk], iters: int) -> float:
    """Wall ms of runner.execute, synchronised after each (host work included)."""
    run_chunks(runner, chunks)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run_chunks(runner, chunks)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_split(fn, steps: int = 3, top: int = 15) -> dict:
    """Per-kernel device time of fn() (torch.profiler, mean over `steps` calls) -> total_us, the `top`
    kernels (name, us, calls, share of the total) and other_us; no kernels when none was recorded."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = e.self_cuda_time_total
        if dev_us > 0 and getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU:
            rows.append((e.key, dev_us / steps, e.count // steps))
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    kernels = [{"name": n[:90], "us": us, "calls": c, "share": us / total} for n, us, c in rows[:top]]
    return {"total_us": total, "kernels": kernels, "other_us": sum(r[1] for r in rows[top:])}


def profile_step(runner: ModelRunner, ops: str, chunks: list[Chunk], steps: int = 3,
                 top: int = 15) -> dict:
    """Per-kernel device time of one replayed step (mean over `steps`); falls back to an eager step with the
    same decoder ops if the profiler records no kernels inside graph replays."""
    run_chunks(runner, chunks)
    split = kernel_split(graph_step(runner, len(chunks)), steps, top)
    mode = "graph replay"
    if not split["kernels"]:
        graphs, runner.graphs = runner.graphs, None
        runner.model.set_decoder_ops(ops)
        try:
            split = kernel_split(lambda: run_chunks(runner, chunks), steps, top)
            mode = "eager (no kernels traced in graph replays)"
        finally:
            runner.graphs = graphs
            runner.model.set_decoder_ops("auto")
    return {"mode": mode, "batch": len(chunks)} | split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    ap.add_argument("--context", type=int, default=576, help="cached tokens per sequence")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="graph block-table width; default: the preset's max_position_embeddings, as served")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--profile-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64],
                    help="batch sizes whose replayed step gets a per-kernel split")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)

    copy_bw = copy_bandwidth()
    model, _ = load_model("bench", "cuda", torch.bfloat16)
    cfg = model.config
    ctx = Contexts(max(args.batches), args.context, args.block_size)
    runners, startup = {}, {}
    for ops in OPS:
        runners[ops], startup[ops] = build_runner(model, ops, ctx, args)
    model.set_decoder_ops("auto")
    runners["torch"].kv.data.normal_()
    for ops in OPS[1:]:
        runners[ops].kv.data.copy_(runners["torch"].kv.data)  # the same cached K/V behind each
    w_bytes = weight_bytes(model)

    rows = []
    for batch in args.batches:
        chunks = ctx.chunks(batch)
        logits = {ops: run_chunks(runners[ops], chunks) for ops in OPS}
        finite = torch.isfinite(logits["torch"])  # the preset masks non-printable ids with -inf
        ref, fused = logits["torch"][finite], logits["fused"][finite]
        rel = float((fused - ref).abs().max() / ref.abs().max())
        nbytes = w_bytes + kv_bytes(cfg, args.context + 1, batch, model.dtype)
        roofline_ms = nbytes / copy_bw * 1e3
        row = {"batch": batch, "bytes": nbytes, "roofline_ms": roofline_ms, "fused_vs_torch_rel_err": rel,
               "target_ms": TARGETS_MS.get(batch)}
        for ops in OPS:
            ms = cuda_ms(graph_step(runners[ops], batch), args.iters)
            row[ops] = {"step_ms": ms, "tb_s": nbytes / (ms * 1e-3) / 1e12, "roofline_frac": roofline_ms / ms,
                        "execute_ms": execute_ms(runners[ops], chunks, args.iters // 2)}
        rows.append(row)
        print(f"batch {batch}: torch {row['torch']['step_ms']:.3f} ms, "
              f"fused {row['fused']['step_ms']:.3f} ms", flush=True)

    profiles = [profile_step(runners[ops], ops, ctx.chunks(batch)) | {"ops": ops}
                for batch in args.profile_batches for ops in OPS]
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "preset": "bench", "dtype": "bfloat16",
        "context": args.context, "block_size": args.block_size,
        "max_model_len": runners["fused"].max_model_len, "copy_bw_tb_s": copy_bw / 1e12,
        "weight_bytes": w_bytes, "startup": startup, "rows": rows, "profiles": profiles,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = gpu_tag(torch.cuda.get_device_name())  # decode_forward_h200, decode_forward_h100, ...
    path = args.out / f"decode_forward_{gpu}.json"
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(markdown(result))
    print_report(result, path)


def print_report(r: dict, path: Path) -> None:
    for p in r["profiles"]:
        ops = p["ops"]
        print(f"\n{ops}: per-kernel device time of one step at batch {p['batch']} ({p['mode']}), "
              f"total {p['total_us']:.0f} us")
        for k in p["kernels"]:
            print(f"  {k['us']:8.1f} us {k['share']:6.1%} x{k['calls']:<4d} {k['name']}")
        print(f"  {p['other_us']:8.1f} us  other")
    print("\nstart-up: " + ", ".join(f"{ops} {s['init_s']:.1f} s, graphs {s['graphs_mib']:.0f} MiB"
                                      for ops, s in r["startup"].items()))
    print(f"{r['gpu']}, torch {r['torch']}, triton {r['triton']}; bench preset bf16, context {r['context']}, "
          f"block {r['block_size']}, tables for {r['max_model_len']} tokens; "
          f"copy {r['copy_bw_tb_s']:.2f} TB/s; "
          f"weights {r['weight_bytes'] / 1e9:.2f} GB; JSON {path}")
    baselines = "".join(f"{ops.removeprefix('fused_') + ' ms':>8} " for ops in BASELINE_TITLES)  # gemm ms ...
    print(f"{'batch':>5} {'roofline':>9} {'torch ms':>9} {baselines}"
          f"{'fused ms':>9} {'fused TB/s':>10} "
          f"{'of roof':>8} {'target':>7} {'exec torch':>10} {'exec fused':>10} {'rel err':>8}")
    for row in r["rows"]:
        t, f = row["torch"], row["fused"]
        target = row["target_ms"]
        verdict = "" if target is None else f"{target:.2f}{'ok' if f['step_ms'] <= target else '!!'}"
        print(f"{row['batch']:>5} {row['roofline_ms']:>9.3f} {t['step_ms']:>9.3f} "
              + "".join(f"{row[ops]['step_ms']:>8.3f} " for ops in BASELINE_TITLES)
              + f"{f['step_ms']:>9.3f} "
              f"{f['tb_s']:>10.2f} {f['roofline_frac']:>8.1%} {verdict:>7} {t['execute_ms']:>10.3f} "
              f"{f['execute_ms']:>10.3f} {row['fused_vs_torch_rel_err']:>8.1e}")


def markdown(r: dict) -> str:
    """The same figures as a docs/benchmarks page: setup, the step table, the per-kernel splits."""
    lines = [
        "# Decode forward (CUDA-graph step, logits included): torch ops vs fused Triton ops", "",
        f"{r['gpu']}, torch {r['torch']}, triton {r['triton']}, Python {r['python']}. `bench` preset "
        f"(Llama-3.2-1B shape, random weights) in bf16, {r['context']} cached tokens per sequence, "
        f"block size {r['block_size']}, graph tables for {r['max_model_len']} tokens. Roofline: (weights "
        f"{r['weight_bytes'] / 1e9:.2f} GB + KV read) / the device-to-device copy bandwidth measured in "
        f"the same run, {r['copy_bw_tb_s']:.2f} TB/s. `python -m tools.decode_forward_bench --out DIR`.", "",
        "| batch | roofline ms | torch ms | " + " | ".join(f"{t} ms" for t in BASELINE_TITLES.values())
        + " | fused ms | fused TB/s | of roofline | target ms | execute torch ms | execute fused ms "
        "| fused vs torch rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        t, f = row["torch"], row["fused"]
        target = "" if row["target_ms"] is None else f"{row['target_ms']:.2f}"
        lines.append(f"| {row['batch']} | {row['roofline_ms']:.3f} | {t['step_ms']:.3f} | "
                     + "".join(f"{row[ops]['step_ms']:.3f} | " for ops in BASELINE_TITLES)
                     + f"{f['step_ms']:.3f} | {f['tb_s']:.2f} | "
                     f"{f['roofline_frac']:.1%} | {target} | "
                     f"{t['execute_ms']:.3f} | {f['execute_ms']:.3f} | {row['fused_vs_torch_rel_err']:.1e} |")
    startup = ", ".join(f"{ops} {s['init_s']:.1f} s and {s['graphs_mib']:.0f} MiB"
                        for ops, s in r["startup"].items())
    lines += ["", f"Start-up (runner construction, graph capture included): {startup}."]
    for p in r["profiles"]:
        ops = p["ops"]
        lines += ["", f"## {ops}: one step at batch {p['batch']}, per kernel ({p['mode']}), "
                      f"{p['total_us']:.0f} us of kernels", "",
                  "| us | share | calls | kernel |", "|---|---|---|---|"]
        lines += [f"| {k['us']:.1f} | {k['share']:.1%} | {k['calls']} | `{k['name']}` |"
                  for k in p["kernels"]]
        lines.append(f"| {p['other_us']:.1f} | | | other |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
