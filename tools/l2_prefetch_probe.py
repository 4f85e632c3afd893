"""Probe (GPU, not a test): `python -m tools.l2_prefetch_probe [--out DIR]`.

Does pulling the next projections' weights into L2 on a side stream, while the attention runs, shorten the
decode step? The `bench` preset in bf16 (576 cached tokens, block 16) behind ModelRunners whose CUDA graphs
were captured with the shipped fused forward and with variants of it that fork a side stream after the qkv
projection (RoPE + K/V store) and prefetch, beside the attention:
- one row (the GEMV route): o_proj's weights, and the first MB of gate_up's gate and up halves (the rows its
  first programs read), with or without the evict-last hint;
- 64 rows (the GEMM route): o_proj's weights (8.4 MB; the attention streams 75 MB of K/V through L2 then).
The side stream joins the main one when the forward returns (before the lm_head; in the recorded run,
docs/benchmarks/l2_prefetch_h200.json with the probe as of 86e0638, it joined before the final norm). A step
is the graph replay plus the fp32 logits copy (tools/decode_forward_bench's step), timed in rounds that
alternate every runner; logits of every variant must equal the shipped forward's bit for bit (a prefetch
moves no data).
Prints a table; writes l2_prefetch_<gpu>.json under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

import server.model.fused_forward as ff
from server.model import load_model
from tests.runner_chunks import run_chunks
from tools.decode_forward_bench import Contexts, build_runner, copy_bandwidth, cuda_ms, graph_step
from tools.kernel_bench import gpu_tag

SHIPPED, SHIPPED_ATTEND, SHIPPED_ROPE_ATTEND = ff.fused_forward, ff._attend, ff._rope_attend

LINE = 128            # bytes a prefetch names (one L2 line)
LINES_PER_PROGRAM = 1024  # 128 KiB a program: 8 prefetches a thread at 4 warps


@triton.jit
def _l2_prefetch_kernel(BASE, n_lines, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Program p prefetches lines [p LINES, (p + 1) LINES) of the range at BASE (uint8); the last program's
    tail repeats the final line (a prefetch writes nothing, so a repeat costs one request)."""
    line = tl.program_id(0) * LINES + tl.arange(0, LINES)
    line = tl.minimum(line, n_lines - 1)
    ptrs = BASE + line.to(tl.int64) * 128
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None, evict_last: bool = False) -> None:
    """Prefetches the first `nbytes` (default: all) of contiguous CUDA tensor t into L2 on the current
    stream."""
    if t.device.type != "cuda" or not t.is_contiguous():
        raise ValueError(f"l2_prefetch takes a contiguous CUDA tensor, got {t.device} "
                         f"contiguous={t.is_contiguous()}")
    total = t.numel() * t.element_size()
    nbytes = total if nbytes is None else min(int(nbytes), total)
    if nbytes <= 0:
        return
    n_lines = triton.cdiv(nbytes, LINE)
    _l2_prefetch_kernel[(triton.cdiv(n_lines, LINES_PER_PROGRAM),)](
        t.view(-1).view(torch.uint8), n_lines, LINES=LINES_PER_PROGRAM, EVICT_LAST=evict_last, num_warps=4)



@dataclass(frozen=True)
class Variant:
    name: str
    o_proj: bool = True       # prefetch o_proj's weights
    gate_up_mb: float = 0.0   # and this many MB of gate_up (half from each of the gate and up halves)
    evict_last: bool = False


VARIANTS = (
    Variant("o"), Variant("o+gu8", gate_up_mb=8), Variant("o+gu16", gate_up_mb=16),
    Variant("o+gu32", gate_up_mb=32), Variant("o el", evict_last=True),
    Variant("o+gu16 el", gate_up_mb=16, evict_last=True),
)


def prefetch_weights(layer, v: Variant) -> None:
    """On the current stream: the variant's share of this layer's o_proj and gate_up weights."""
    if v.o_proj:
        l2_prefetch(layer.self_attn.o_proj.weight, evict_last=v.evict_last)
    if v.gate_up_mb:
        w = layer.mlp.gate_up_proj.weight  # (2I, H): [gate | up]
        n = w.shape[0] // 2
        rows = min(n, int(v.gate_up_mb * 1e6 / 2 / (w.shape[1] * w.element_size())))
        l2_prefetch(w[:rows], evict_last=v.evict_last)
        l2_prefetch(w[n:n + rows], evict_last=v.evict_last)


def forward_with_prefetch(v: Variant, side: torch.cuda.Stream, layers):
    """The shipped fused_forward with a side-stream prefetch forked after each layer's qkv projection: its
    own `_attend` (called after the qkv GEMV with RoPE + K/V store, the one-row route) and `_rope_attend`
    (called after the qkv GEMM) are wrapped for the call, and the side stream joins once the forward
    returns."""

    def fork(mod) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefetch_weights(layers[mod.layer_idx], v)

    def attend(mod, qkv, attn):
        fork(mod)
        return SHIPPED_ATTEND(mod, qkv, attn)

    def rope_attend(layer, qkv, residual, cos, sin, attn):
        fork(layer.self_attn)
        return SHIPPED_ROPE_ATTEND(layer, qkv, residual, cos, sin, attn)

    def forward(model, input_ids, positions, attn, out_rows=None):
        ff._attend, ff._rope_attend = attend, rope_attend
        try:
            hidden = SHIPPED(model, input_ids, positions, attn, out_rows)
        finally:
            ff._attend, ff._rope_attend = SHIPPED_ATTEND, SHIPPED_ROPE_ATTEND
        torch.cuda.current_stream().wait_stream(side)
        return hidden

    return forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--context", type=int, default=576)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    args.block_size, args.max_model_len = 16, None
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    model, _ = load_model("bench", "cuda", torch.bfloat16)
    ctx = Contexts(max(args.batches), args.context, args.block_size)
    side = torch.cuda.Stream()
    runners = {"shipped": build_runner(model, "fused", ctx, args)[0]}
    for v in VARIANTS:
        ff.fused_forward = forward_with_prefetch(v, side, model.model.layers)
        try:
            runners[v.name] = build_runner(model, "fused", ctx, args)[0]
        finally:
            ff.fused_forward = SHIPPED
    model.set_decoder_ops("auto")
    runners["shipped"].kv.data.normal_()
    for name, r in runners.items():
        if name != "shipped":
            r.kv.data.copy_(runners["shipped"].kv.data)

    rows = []
    for batch in args.batches:
        chunks = ctx.chunks(batch)
        ref = run_chunks(runners["shipped"], chunks)
        same = {n: bool(torch.equal(run_chunks(r, chunks), ref)) for n, r in runners.items()}
        times = {n: [] for n in runners}
        for _ in range(args.rounds):
            for n, r in runners.items():
                times[n].append(cuda_ms(graph_step(r, batch), args.iters, repeats=3))
        base = statistics.median(times["shipped"])
        for n in runners:
            ms = statistics.median(times[n])
            rows.append({"batch": batch, "variant": n, "step_ms": ms, "vs_shipped": base / ms,
                         "logits_equal": same[n], "rounds_ms": times[n]})
            print(f"b{batch} {n:12s} {ms:.4f} ms  x{base / ms:.3f}  equal={same[n]}", flush=True)

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "context": args.context, "copy_bw_tb_s": copy_bw / 1e12,
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = gpu_tag(torch.cuda.get_device_name())
    path = args.out / f"l2_prefetch_{gpu}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}, copy "
          f"{copy_bw / 1e12:.2f} TB/s; JSON {path}")
    print(f"{'batch':>5} {'variant':>12} {'step ms':>8} {'speed':>6} {'equal':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['variant']:>12} {r['step_ms']:>8.4f} {r['vs_shipped']:>6.3f} "
              f"{str(r['logits_equal']):>6}")


if __name__ == "__main__":
    main()
