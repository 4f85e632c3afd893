"""Inductor over the torch decoder ops, against the shipped fused forward (GPU probe, not a test):
`python -m tools.compile_forward_probe --out DIR`.

Issue 16 asks that the decode forward's fusions be chosen by measurement: `torch.compile` (Inductor) over
the decoder with the paged attention and the K/V store registered as custom ops (`torch.library`), or
hand-written Triton kernels (what ships: server/model/fused_forward.py). This probe measures the first way.

In one process, the `bench` preset (Llama-3.2-1B shape, random weights, bf16):
- "fused": a ModelRunner with the fused ops and its CUDA decode graphs, as served
  (tools.decode_forward_bench);
- "inductor <mode>": the torch decoder modules (server/model/llama.py) and the lm_head, compiled whole
  (fullgraph) at each batch size, the K/V store + paged decode attention one opaque custom op
  (`pagewalk_probe::store_and_attend`, the same Triton kernels the runner launches, with the same split
  count and in-launch merge workspace), then captured in a CUDA graph of its own.
Both read the same cached K/V (--context tokens a sequence in shuffled blocks, tables as wide as the served
max_model_len) and decode one token a sequence. One step = graph replay + the argmax of the bf16 logits
(kernels/argmax.py, as the engine's greedy step), timed with CUDA events over back-to-back steps. Also: the
compile time, each bf16 path's logit deviation from the eager bf16 torch ops over the same custom op (the
reference both are measured against), and a per-kernel split of one replayed step at --profile-batches.
Results: docs/benchmarks/compile_forward_h100.md.

`--smoke` runs the tracing on the CPU (tiny preset, the kernels' torch backend, dynamo backend aot_eager, no
graphs): the custom op's fake and real implementations, fullgraph tracing, logits equal to the eager modules.
Prints a table; writes compile_forward_<gpu>.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import platform
import time
from pathlib import Path

import torch

import kernels
from server.engine.attention import decode_splits
from server.engine.kv_cache_tensors import KVCacheTensors
from server.model import load_model
from tests.runner_chunks import run_chunks
from tools.decode_forward_bench import (
    Contexts,
    build_runner,
    copy_bandwidth,
    cuda_ms,
    graph_step,
    kernel_split,
)
from tools.kernel_bench import gpu_tag

log = logging.getLogger(__name__)


@torch.library.custom_op("pagewalk_probe::store_and_attend", mutates_args=("kv_data",))
def store_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_data: torch.Tensor, layer: int,
                     slots: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     num_splits: int) -> torch.Tensor:
    """q (B, Hq, D), k/v (B, Hkv, D) of one decode step -> (B, Hq, D) contiguous: stores k/v at `slots` of
    layer `layer` of the whole cache kv_data (L, 2, N, bs, Hkv, D), then attends over it (the runner's two
    launches; the merge workspace is WORKSPACE's). The op mutates the cache tensor itself, not a view of it:
    a custom op mutating views of a graph input makes Inductor copy the viewed base around each call (the
    first GPU run did, as_strided + clone of the cache, and faulted)."""
    k_cache, v_cache = kv_data[layer, 0], kv_data[layer, 1]  # (N, bs, Hkv, D) each
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=num_splits,
                                   out=out, workspace=WORKSPACE.get(q.device))
    return out


@store_and_attend.register_fake
def _(q, k, v, kv_data, layer, slots, block_tables, seq_lens, num_splits):
    return q.new_empty(q.shape)


WORKSPACE: dict[torch.device, kernels.DecodeWorkspace] = {}  # one per device; graph replays run in order


class OpaqueAttention:
    """The model's AttentionFn over the custom op; backend "torch" so LlamaForCausalLM takes its torch ops."""

    backend = "torch"

    def __init__(self, kv_data, slots, block_tables, seq_lens, num_splits: int) -> None:
        self.kv_data, self.slots, self.num_splits = kv_data, slots, num_splits  # (L, 2, N, bs, Hkv, D)
        self.block_tables, self.seq_lens = block_tables, seq_lens

    def __call__(self, layer_idx, q, k, v):
        return torch.ops.pagewalk_probe.store_and_attend(q, k, v, self.kv_data, layer_idx, self.slots,
                                                         self.block_tables, self.seq_lens, self.num_splits)


def decode_logits(model, attn, input_ids, positions):
    """The torch decoder ops of one decode step and the lm_head: (B,) ids -> (B, V) model-dtype logits."""
    m = model.model
    x = m.embed_tokens(input_ids)  # (B, H)
    cos, sin = m.rotary(positions, x.dtype)  # (B, 1, D)
    for layer in m.layers:
        x = layer(x, cos, sin, attn)
    return model.lm_head(m.norm(x))  # (B, V)


class StepInputs:
    """Device inputs of a decode step of `batch` sequences of `context` cached tokens (Contexts' tables)."""

    def __init__(self, ctx, batch: int, width: int, device) -> None:
        bs, t = ctx.block_size, ctx.context
        tables = torch.zeros(batch, width, dtype=torch.int32)
        for i in range(batch):
            tables[i, : len(ctx.tables[i])] = torch.tensor(ctx.tables[i], dtype=torch.int32)
        self.block_tables = tables.to(device)  # (B, width), padded with the null block 0
        self.seq_lens = torch.full((batch,), t + 1, dtype=torch.int32, device=device)
        self.positions = torch.full((batch,), t, dtype=torch.int64, device=device)
        self.slots = torch.tensor([ctx.tables[i][t // bs] * bs + t % bs for i in range(batch)],
                                  dtype=torch.int64, device=device)
        self.input_ids = torch.tensor(ctx.tokens[:batch], dtype=torch.int64, device=device)


def compiled_step(model, kv, inputs: StepInputs, mode: str | None, backend: str = "inductor"):
    """-> (fn() returning (B, V) logits, compile seconds): the decode step compiled at this batch size."""
    k_cache = kv.layer(0)[0]
    splits = decode_splits(inputs.input_ids.shape[0], k_cache, inputs.block_tables.shape[1], None)
    attn = OpaqueAttention(kv.data, inputs.slots, inputs.block_tables, inputs.seq_lens, splits)
    torch._dynamo.reset()
    fn = torch.compile(lambda ids, pos: decode_logits(model, attn, ids, pos), fullgraph=True, dynamic=False,
                       backend=backend, mode=mode)
    start = time.perf_counter()
    fn(inputs.input_ids, inputs.positions)
    if k_cache.is_cuda:
        torch.cuda.synchronize()
    return (lambda: fn(inputs.input_ids, inputs.positions)), time.perf_counter() - start


def graphed(fn, warmups: int = 3):
    """Captures fn() in a CUDA graph -> (replay(), its output tensor)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def replay_and_argmax(replay, argmax, logits):
    replay()
    return argmax(logits)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    finite = torch.isfinite(ref)  # the preset masks unprintable ids with -inf
    a, ref = a.float()[finite], ref.float()[finite]
    return float((a - ref).abs().max() / ref.abs().max())


def smoke() -> None:
    """CPU: fullgraph tracing with the custom op (aot_eager), logits equal to the eager torch ops."""
    model, _ = load_model("tiny", "cpu", torch.float32)
    cfg = model.config
    ctx = Contexts(4, 40, 16)
    kv = KVCacheTensors(cfg.num_layers, ctx.num_blocks, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                        "cpu")
    kv.data.normal_()
    inputs = StepInputs(ctx, 4, 8, "cpu")
    splits = decode_splits(4, kv.layer(0)[0], 8, None)
    attn = OpaqueAttention(kv.data, inputs.slots, inputs.block_tables, inputs.seq_lens, splits)
    with torch.no_grad():
        eager = decode_logits(model, attn, inputs.input_ids, inputs.positions)
        step, seconds = compiled_step(model, kv, inputs, None, backend="aot_eager")
        traced = step()
    err = rel_err(traced, eager)
    print(f"smoke: aot_eager fullgraph traced in {seconds:.1f} s, rel err vs eager {err:.1e}")
    assert err < 1e-5, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    ap.add_argument("--modes", default="default", help="comma list of torch.compile modes; 'default' = None")
    ap.add_argument("--autotune-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[64],
                    help="batch sizes also compiled with mode max-autotune-no-cudagraphs")
    ap.add_argument("--context", type=int, default=576)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--profile-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[64])
    ap.add_argument("--smoke", action="store_true", help="CPU tracing check only")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.smoke:
        smoke()
        return
    torch.manual_seed(0)
    torch._dynamo.config.cache_size_limit = 64
    copy_bw = copy_bandwidth()
    model, _ = load_model("bench", "cuda", torch.bfloat16)
    ctx = Contexts(max(args.batches), args.context, args.block_size)
    runner, startup = build_runner(model, "fused", ctx, args)  # folds the norms: both paths run those weights
    model.set_decoder_ops("auto")
    runner.kv.data.normal_()
    WORKSPACE[runner.kv.data.device] = kernels.DecodeWorkspace(max(args.batches), model.config.num_kv_heads,
                                                               runner.kv.data.device)
    width = runner.max_model_len // args.block_size
    argmax = runner.sampler.argmax
    rows, profiles = [], []
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compile_forward_{gpu_tag(torch.cuda.get_device_name())}.json"
    for batch in args.batches:
        chunks = ctx.chunks(batch)
        inputs = StepInputs(ctx, batch, width, "cuda")
        with torch.no_grad():  # the eager torch ops over the same custom op: the reference of both
            eager_step, _ = compiled_step(model, runner.kv, inputs, None, backend="eager")
            eager = eager_step()
        fused_logits = run_chunks(runner, chunks)
        fused_ms = cuda_ms(graph_step(runner, batch), args.iters)
        row = {"batch": batch, "fused_ms": fused_ms, "fused_vs_eager": rel_err(fused_logits, eager),
               "inductor": {}}
        modes = args.modes.split(",")
        if batch in args.autotune_batches:
            modes.append("max-autotune-no-cudagraphs")
        for mode in modes:
            with torch.no_grad():
                fn, compile_s = compiled_step(model, runner.kv, inputs, None if mode == "default" else mode)
                replay, out = graphed(fn)
            replay()
            err = rel_err(out, eager)
            step = functools.partial(replay_and_argmax, replay, argmax, out)
            ms = cuda_ms(step, args.iters)
            row["inductor"][mode] = {"step_ms": ms, "compile_s": compile_s, "vs_eager": err}
            print(f"batch {batch}: fused {fused_ms:.3f} ms, inductor {mode} {ms:.3f} ms "
                  f"(compile {compile_s:.0f} s, rel err {err:.1e})", flush=True)
            if batch in args.profile_batches:
                profiles.append({"batch": batch, "ops": f"inductor {mode}"}
                                | kernel_split(step, top=12))
        if batch in args.profile_batches:
            fused_step = graph_step(runner, batch)
            profiles.append({"batch": batch, "ops": "fused"} | kernel_split(fused_step, top=12))
        rows.append(row)
        result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "triton": __import__("triton").__version__, "python": platform.python_version(),
                  "preset": "bench", "dtype": "bfloat16", "context": args.context,
                  "block_size": args.block_size, "copy_bw_tb_s": copy_bw / 1e12, "fused_startup": startup,
                  "rows": rows, "profiles": profiles}
        path.write_text(json.dumps(result, indent=1))  # after every batch: a cut-off run keeps what it has
    report(result, path)


def report(r: dict, path: Path) -> None:
    for p in r["profiles"]:
        print(f"\n{p['ops']}: one step at batch {p['batch']}, {p['total_us']:.0f} us of kernels")
        for k in p["kernels"]:
            print(f"  {k['us']:8.1f} us x{k['calls']:<4d} {k['name']}")
        print(f"  {p['other_us']:8.1f} us  other")
    print(f"\n{r['gpu']}, torch {r['torch']}, triton {r['triton']}; bench bf16, context {r['context']}, "
          f"copy {r['copy_bw_tb_s']:.2f} TB/s; JSON {path}")
    print(f"{'batch':>5} {'fused ms':>9} {'mode':>28} {'inductor ms':>11} {'vs fused':>8} {'compile s':>9} "
          f"{'err fused':>9} {'err ind.':>9}")
    for row in r["rows"]:
        for mode, m in row["inductor"].items():
            print(f"{row['batch']:>5} {row['fused_ms']:>9.3f} {mode:>28} {m['step_ms']:>11.3f} "
                  f"{m['step_ms'] / row['fused_ms']:>8.2f} {m['compile_s']:>9.0f} "
                  f"{row['fused_vs_eager']:>9.1e} {m['vs_eager']:>9.1e}")


if __name__ == "__main__":
    main()
