"""Probe (GPU, not a test): does the one-row step gain when the decode attention launches early behind the
qkv GEMV? `python -m tools.pdl_attention_probe [--out DIR]`.

The `bench` preset in bf16 (576 cached tokens, block 16) behind ModelRunners captured with the shipped fused
forward and with the attention launched with programmatic dependent launch, executing griddepcontrol.wait
before anything else (the qkv GEMV lets its successor launch at its start, so the attention's launch and
program start-up overlap the GEMV; it never lets the o_proj GEMV launch early, which three earlier trials
found slower). Steps (graph replay + fp32 logits copy) timed in alternating rounds; every variant's logits
must equal the shipped forward's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import torch
import triton

import kernels.paged_decode as paged_decode
import server.model.fused_forward as ff
from server.model import load_model
from tests.runner_chunks import run_chunks
from tools.decode_forward_bench import Contexts, build_runner, copy_bandwidth, cuda_ms, graph_step

SHIPPED_LAYER = ff._layer_one_row


VARIANTS = {"shipped": (False, SHIPPED_LAYER), "attn waits": (True, SHIPPED_LAYER)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--context", type=int, default=576)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    args.block_size, args.max_model_len = 16, None
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    model, _ = load_model("bench", "cuda", torch.bfloat16)
    ctx = Contexts(max(args.batches), args.context, args.block_size)
    runners = {}
    for name, (trigger, layer) in VARIANTS.items():
        paged_decode.PDL_WAIT[0] = trigger
        paged_decode._PLANS.clear()  # plans bind their constexprs: rebuild them under this setting
        ff._layer_one_row = layer
        try:
            runners[name] = build_runner(model, "fused", ctx, args)[0]
        finally:
            ff._layer_one_row = SHIPPED_LAYER
            paged_decode.PDL_WAIT[0] = False
            paged_decode._PLANS.clear()
    model.set_decoder_ops("auto")
    base = runners["shipped"]
    base.kv.data.normal_()
    for r in runners.values():
        if r is not base:
            r.kv.data.copy_(base.kv.data)
    rows = []
    for batch in args.batches:
        chunks = ctx.chunks(batch)
        ref = run_chunks(base, chunks)
        same = {n: bool(torch.equal(run_chunks(r, chunks), ref)) for n, r in runners.items()}
        times = {n: [] for n in runners}
        for _ in range(args.rounds):
            for n, r in runners.items():
                times[n].append(cuda_ms(graph_step(r, batch), args.iters, repeats=3))
        ms0 = statistics.median(times["shipped"])
        for n in runners:
            ms = statistics.median(times[n])
            rows.append({"batch": batch, "variant": n, "step_ms": ms, "vs_shipped": ms0 / ms,
                         "logits_equal": same[n], "rounds_ms": times[n]})
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "context": args.context, "copy_bw_tb_s": copy_bw / 1e12, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"pdl_attention_{torch.cuda.get_device_name().split()[-1].lower()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{result['gpu']}, torch {result['torch']}, triton {result['triton']}; JSON {path}")
    print(f"{'batch':>5} {'variant':>20} {'step ms':>8} {'speed':>6} {'equal':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['variant']:>20} {r['step_ms']:>8.4f} {r['vs_shipped']:>6.3f} "
              f"{str(r['logits_equal']):>6}")


if __name__ == "__main__":
    main()
