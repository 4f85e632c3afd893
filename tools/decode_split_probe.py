"""Probe (GPU, not a test), the decode attention's split count at the served shape:
`python -m tools.decode_split_probe [--shapes 64:577 256:577] [--splits 1 2 3 4 6 8]`.

The decode step's attention as the runner launches it: the `bench` preset's heads (Hq 32, Hkv 8, D 64,
bf16, block 16), block tables as wide as the served max_model_len (8192 blocks: 131072 tokens; the split
count is fixed per call and each sequence's splits are sized from its own length), a DecodeWorkspace (the
in-launch merge). 16 layers' caches, one launch each, captured in one CUDA graph, so that no layer reads
another's K/V from L2 (a decode step's layers do not either). Per (batch, context): torch SDPA on the same
K/V laid out contiguously (enable_gqa, its own graph; the baseline), then ours at the heuristic's split
count (kernels.decode_num_splits over the table width, what the runner passes) and at each --splits count.
Prints µs a layer, TB/s (K/V bytes read / time), the speed against SDPA and the max error against SDPA;
JSON to $OUT/decode_split_probe.json. It decides whether the runner's split count at short contexts
should depart from the table-width heuristic.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
import torch.nn.functional as F
import triton

import kernels

HQ, HKV, D, BLOCK, LAYERS, TABLE_BLOCKS = 32, 8, 64, 16, 16, 8192


def graph_us(launch, replays: int = 20) -> float:
    """µs a launch of `launch` (LAYERS launches: one a layer) captured once and replayed back to back."""
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays / LAYERS)
    return sorted(times)[len(times) // 2]


def shape_rows(batch: int, context: int, split_counts: list[int], gen: torch.Generator) -> list[dict]:
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    caches = [(torch.randn(num_blocks, BLOCK, HKV, D, generator=gen, dtype=torch.bfloat16, device="cuda"),
               torch.randn(num_blocks, BLOCK, HKV, D, generator=gen, dtype=torch.bfloat16, device="cuda"))
              for _ in range(LAYERS)]
    ids = list(range(1, num_blocks))
    random.Random(batch * 100_003 + context).shuffle(ids)
    tables = torch.zeros(batch, TABLE_BLOCKS, dtype=torch.int32)
    for i in range(batch):
        tables[i, :blocks_per_seq] = torch.tensor(ids[i * blocks_per_seq:(i + 1) * blocks_per_seq])
    tables = tables.cuda()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, generator=gen, dtype=torch.bfloat16, device="cuda")
    # the same K/V contiguous for SDPA: (B, Hkv, L, D) per layer
    flat = tables[:, :blocks_per_seq].long()
    contig = [(k[flat].reshape(batch, -1, HKV, D)[:, :context].transpose(1, 2).contiguous(),
               v[flat].reshape(batch, -1, HKV, D)[:, :context].transpose(1, 2).contiguous())
              for k, v in caches]
    kv_bytes = 2 * batch * context * HKV * D * 2
    q4 = q[:, :, None, :]  # (B, Hq, 1, D)
    ref = F.scaled_dot_product_attention(q4.float(), contig[0][0].float(), contig[0][1].float(),
                                         enable_gqa=True)[:, :, 0]
    sdpa_out = torch.empty(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")

    def sdpa():
        for k, v in contig:
            sdpa_out.copy_(F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))

    rows = [{"batch": batch, "context": context, "variant": "SDPA contiguous", "us": graph_us(sdpa)}]
    heuristic = kernels.decode_num_splits(batch, HKV, TABLE_BLOCKS * BLOCK, "cuda")
    workspace = kernels.DecodeWorkspace(batch, HKV, "cuda")
    out = torch.empty(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    for splits in [heuristic] + [s for s in split_counts if s != heuristic]:
        def ours(splits=splits):
            for k, v in caches:
                kernels.paged_decode_attention(q, k, v, tables, lens, num_splits=splits, out=out,
                                               workspace=workspace)
        out.fill_(float("nan"))
        kernels.paged_decode_attention(q, *caches[0], tables, lens, num_splits=splits, out=out,
                                       workspace=workspace)
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        name = f"ours, {splits} split{'s' if splits > 1 else ''}" + (" (heuristic)" if splits == heuristic
                                                                   else "")
        rows.append({"batch": batch, "context": context, "variant": name, "splits": splits,
                     "us": graph_us(ours), "rel_err": err})
    base = rows[0]["us"]
    for r in rows:
        r["TBps"] = kv_bytes / (r["us"] * 1e-6) / 1e12
        r["vs_sdpa"] = base / r["us"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1:577", "16:577", "64:577", "256:577", "64:2048",
                                                    "64:8192"], help="batch:context")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for spec in args.shapes:
        batch, context = map(int, spec.split(":"))
        rows += shape_rows(batch, context, args.splits, gen)
        torch.cuda.empty_cache()
        for r in rows[-len(args.splits) - 2:]:
            print(f"B {r['batch']:>3} L {r['context']:>5} {r['variant']:<26} {r['us']:8.2f} us a layer "
                  f"{r['TBps']:5.2f} TB/s {r['vs_sdpa']:5.2f}x SDPA err {r.get('rel_err', 0):.1e}",
                  flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "heads": [HQ, HKV, D], "block_size": BLOCK, "table_blocks": TABLE_BLOCKS, "layers": LAYERS,
              "rows": rows}
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "decode_split_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}; Hq {HQ}, Hkv {HKV}, "
          f"D {D}, block {BLOCK}, tables of {TABLE_BLOCKS} blocks, {LAYERS} layers a graph")
    print("| batch | context | variant | us a layer | TB/s | vs SDPA | rel err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['variant']} | {r['us']:.2f} | {r['TBps']:.2f} | "
              f"{r['vs_sdpa']:.2f} | {r.get('rel_err', 0):.1e} |")


if __name__ == "__main__":
    main()
