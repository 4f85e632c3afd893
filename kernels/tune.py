"""Config sweep for the paged-decode kernel (not a test): `python -m kernels.tune --out DIR`.

For each benchmark shape, times every (tile config, split count) candidate by GPU-only time (CUDA graph of
L2-clear + call, minus the clear alone), then the best few again with programmatic dependent launch of stage 2
and with do_bench
(median of three). The winners feed the measured table in kernels/split_heuristic.py; the notes on what each
knob did are in docs/kernel_notes.md. Prints a short table last; writes tune.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
import triton

from kernels import paged_decode_attention
from kernels.benchmark import Shape, bench_us, gpu_cold_us, host_us
from kernels.split_heuristic import _MANY_SPLITS, _ONE_SPLIT, KernelConfig

K = KernelConfig
T = True  # table_in_loop
CONFIGS = [K(64, 4, 2), K(64, 4, 2, heads_fastest=T), K(64, 4, 2, early_table=T),
           K(64, 4, 2, heads_fastest=T, early_table=T), K(64, 4, 2, T, heads_fastest=T), K(64, 4, 3),
           K(64, 4, 3, early_table=T), K(64, 4, 3, heads_fastest=T, early_table=T), K(32, 4, 6, T),
           K(32, 4, 6, T, heads_fastest=T)]
SPLITS = {(1, 4096): (16, 32), (1, 32768): (32, 48, 64), (16, 4096): (2, 3, 4),
          (64, 2048): (1, 2), (64, 8192): (1,), (128, 4096): (1,), (256, 1024): (1,)}
BLOCK_SIZE_ROWS = [(64, 8192, 1), (64, 8192, 128)]


def gpu_us_or_inf(fn) -> float:
    try:
        return gpu_cold_us(fn)
    except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is ruled out, not fatal
        print(f"  failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return float("inf")


def sweep_shape(shape: Shape, splits, configs, deadline, workspaces=(False,)) -> list[dict]:
    """GPU-only time of every (config, split count, merge) candidate; workspace True: the in-launch merge."""
    rows = []
    for cfg in configs:
        for s in splits:
            for ws in workspaces if s > 1 else (False,):
                if time.time() > deadline:
                    return rows
                us = gpu_us_or_inf(lambda c=cfg, s=s, ws=ws: shape.ours(s, c, workspace=ws))
                rows.append({"config": dataclasses.asdict(cfg), "splits": s, "workspace": ws, "gpu_us": us})
    return rows


def _side(row: dict, knob: str) -> bool:
    """Which side of an A/B a sweep row is on: the merge (row["workspace"]) or a config flag."""
    return row[knob] if knob in row else row["config"][knob]


def refine_ab(shape: Shape, rows, knob: str, top=2) -> list[dict]:
    """The best `top` candidates of each side of the A/B again, by do_bench (median of three)."""
    out = []
    for side in (False, True):
        mine = sorted((r for r in rows if _side(r, knob) == side and r["gpu_us"] < float("inf")),
                      key=lambda r: r["gpu_us"])[:top]
        for r in mine:
            cfg, s, ws = K(**r["config"]), r["splits"], r["workspace"]
            fn = (lambda s=s, cfg=cfg, ws=ws: shape.ours(s, cfg, workspace=ws))
            out.append({**r, "do_bench_us": statistics.median(bench_us(fn) for _ in range(3))})
    return out


def refine(shape: Shape, rows, top=3) -> list[dict]:
    """The best `top` candidates again: with PDL, and by do_bench (with and without PDL)."""
    best = sorted((r for r in rows if r["gpu_us"] < float("inf")), key=lambda r: r["gpu_us"])[:top]
    out = []
    for r in best:
        for pdl in ((False, True) if r["splits"] > 1 else (False,)):
            cfg = K(**{**r["config"], "pdl": pdl})
            s = r["splits"]
            fn = (lambda s=s, cfg=cfg: shape.ours(s, cfg, workspace=False))
            out.append({"config": dataclasses.asdict(cfg), "splits": s, "workspace": False,
                        "gpu_us": gpu_us_or_inf(fn), "do_bench_us": statistics.median(bench_us(fn)
                                                                                      for _ in range(3))})
    return out


def stage2_alone_us(batch: int, splits: int, hq: int = 32, d: int = 128) -> float:
    """GPU-only time of the merge launch by itself (random partials): what a second launch costs."""
    from kernels.split_merge import merge_stage2
    part = batch * hq * splits * d
    work = torch.randn(part + part // d, device="cuda")
    out = torch.empty(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    block_s = triton.next_power_of_2(splits)
    args = (work[:part], work[part:], out, splits, hq * splits * d, splits * d, d, 1, hq * splits, splits, 1,
            *out.stride())
    return gpu_cold_us(lambda: merge_stage2((batch, hq), *args, HEAD_DIM=d, HEAD_DIM_PAD=d, BLOCK_S=block_s,
                                       CHUNK_S=min(block_s, 16), USE_PDL=False, num_warps=4, num_stages=1))


def host_row(shape: Shape) -> dict:
    c = shape.case
    args = (c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens)
    ws = shape.workspace
    return {"public_host_us": host_us(lambda: paged_decode_attention(*args, workspace=ws), n=2000),
            "sdpa_host_us": host_us(shape.sdpa_contig, n=2000),
            "public_do_bench_us": statistics.median(bench_us(shape.ours) for _ in range(3)),
            "sdpa_do_bench_us": statistics.median(bench_us(shape.sdpa_contig) for _ in range(3)),
            "sdpa_gpu_us": gpu_cold_us(shape.sdpa_contig)}


# deep per-program pipelines, for one split at mid batches: cuDNN runs (16, 4096) as 128 programs, one per
# (sequence, KV head), at 87% of DRAM bandwidth with no merge (ncu, docs/kernel_notes.md run 15)
DEEP_CONFIGS = [K(64, 4, 3, T), K(64, 4, 4, T), K(64, 4, 6, T), K(64, 8, 4, T), K(128, 8, 3, T),
                K(32, 4, 8, T), K(64, 4, 4, T, heads_fastest=T)]
DEEP_SPLITS = {(16, 4096): (1, 2), (1, 32768): (16, 32)}

# the merge in the stage-1 launch (DecodeWorkspace) vs the stage-2 launch, at every shape with splits
MERGE_CONFIGS = [K(64, 4, 3, heads_fastest=T, early_table=T, pdl=T), K(64, 4, 3, early_table=T, pdl=T),
                 K(64, 4, 2, heads_fastest=T, early_table=T, pdl=T), K(32, 4, 6, T, heads_fastest=T, pdl=T)]
MERGE_SPLITS = {(1, 4096): (8, 16, 32), (1, 32768): (32, 48, 64), (16, 4096): (2, 3, 4), (64, 2048): (1, 2)}

# int32 cache offsets (offsets_32) off vs on for the shipped configs, with a workspace (the server's path).
# _SHIPPED is the table as of runs 19-23, before the split config took the evict-first hint (run 26)
_SHIPPED = [K(64, 4, 3, heads_fastest=T, early_table=T, pdl=T), K(64, 4, 2, heads_fastest=T, early_table=T),
            K(32, 4, 6, T, heads_fastest=T)]
OFFSET_CONFIGS = [dataclasses.replace(c, offsets_32=o) for c in _SHIPPED for o in (False, True)]
OFFSET_SPLITS = {(1, 4096): (16, 32), (1, 32768): (32, 48, 64), (16, 4096): (1, 2, 3, 4), (64, 2048): (1, 2),
                 (64, 8192): (1,), (128, 4096): (1,), (256, 1024): (1,)}

# plain loads one tile ahead with the L2 evict-first hint (reg_prefetch) vs the shipped cp.async configs: the
# hint keeps the KV stream from evicting lines already in L2 (do_bench's clear leaves them dirty, run 22)
_RP = dict(heads_fastest=T, early_table=T, reg_prefetch=T)
EVICT_CONFIGS = [*_SHIPPED[:2], K(64, 4, 1, pdl=T, evict_first=T, **_RP),
                 K(32, 4, 1, pdl=T, evict_first=T, **_RP), K(64, 4, 1, pdl=T, **_RP),
                 K(64, 4, 1, evict_first=T, offsets_32=False, **_RP)]
EVICT_SPLITS = {(1, 32768): (32, 64), (16, 4096): (2, 4), (1, 4096): (16,), (64, 2048): (1,),
                (64, 8192): (1,), (128, 4096): (1,), (256, 1024): (1,)}

# the evict-first hint on the cp.async pipeline (kernels/l2_hint.py writes it into the PTX on Triton 3.6) off
# vs on, for the shipped configs with a workspace (the server's path)
HINT_CONFIGS = [dataclasses.replace(c, evict_first=e) for c in _SHIPPED for e in (False, True)]
HINT_SPLITS = {(1, 32768): (32, 48, 64), (16, 4096): (1, 2, 4), (1, 4096): (16, 32), (64, 2048): (1, 2),
               (64, 8192): (1,), (128, 4096): (1,), (256, 1024): (1,)}

# with the hint: tile width, warps, stages and split counts around the split config, at the split shapes
_HS = dict(heads_fastest=T, early_table=T, pdl=T, evict_first=T)
HINT_DEEP_CONFIGS = [_SHIPPED[0], K(64, 4, 3, **_HS), K(64, 4, 4, **_HS), K(64, 4, 5, **_HS),
                     K(64, 8, 3, **_HS), K(128, 8, 2, **_HS), K(128, 8, 3, **_HS), K(32, 4, 4, **_HS),
                     K(32, 4, 8, **_HS), K(64, 4, 3, offsets_32=False, **_HS)]
HINT_DEEP_SPLITS = {(1, 32768): (24, 28, 32, 40), (1, 4096): (8, 16, 24)}

# the split rule: about 1.7 programs per SM (rounded) vs as many as fit in one wave of 2, shipped split config
SPLIT_RULE_CONFIGS = [K(64, 4, 3, **_HS)]
SPLIT_RULE_SPLITS = {(1, 32768): (27, 32), (1, 16384): (28, 32), (2, 32768): (14, 16), (2, 8192): (14, 16),
                     (4, 16384): (7, 8)}

# stage 1 launched with PDL (pdl_wait: its CTAs start while the kernel before it drains) off vs on, for the
# shipped split and one-split configs at the split counts the heuristic picks
_SPLIT_CFG, _ONE_CFG = _MANY_SPLITS, _ONE_SPLIT     # the shipped table's, not copies of it
PDL_WAIT_CONFIGS = [dataclasses.replace(c, pdl_wait=w) for c in (_SPLIT_CFG, _ONE_CFG) for w in (False, True)]
PDL_WAIT_SPLITS = {(1, 4096): (16,), (1, 32768): (27,), (16, 4096): (2,), (64, 2048): (1,), (64, 8192): (1,),
                   (128, 4096): (1,), (256, 1024): (1,)}

# one sequence at about one program per SM (16-20 splits) with deeper pipelines vs the shipped 27 splits
SINGLE_WAVE_CONFIGS = [_SPLIT_CFG, K(64, 4, 5, **_HS), K(64, 4, 6, **_HS), K(128, 8, 3, **_HS),
                       K(64, 8, 4, **_HS)]
SINGLE_WAVE_SPLITS = {(1, 32768): (16, 20, 24, 27)}

# without a ptxas that compiles the cp.async hint (Triton 3.6's own, 12.8): the split config, hint dropped,
# vs plain loads one tile ahead that keep the hint (run 23), at the split counts few long sequences take
_RPF = dict(heads_fastest=T, early_table=T, reg_prefetch=T, evict_first=T)
STOCK_PTXAS_CONFIGS = [_SPLIT_CFG, K(64, 4, 1, **_RPF), K(32, 4, 1, **_RPF), K(64, 8, 1, **_RPF)]
STOCK_PTXAS_SPLITS = {(1, 32768): (24, 27, 32), (1, 16384): (26, 32), (1, 4096): (16,), (2, 32768): (16,),
                      (4, 16384): (8,), (16, 4096): (2,)}

# fewer bytes in flight per program, more programs: deeper pipelines were slower at (1, 32768) (run 27: 5
# stages 52-58 us), so shallower ones with more splits, at the single-sequence shapes
LEAN_CONFIGS = [_SPLIT_CFG, K(64, 4, 2, **_HS), K(32, 4, 3, **_HS), K(32, 4, 2, **_HS), K(128, 8, 2, **_HS),
                K(64, 8, 2, **_HS)]
LEAN_SPLITS = {(1, 32768): (27, 32, 40, 48, 64), (1, 16384): (26, 32, 48)}

FINAL_CONFIGS = [K(64, 4, 2, heads_fastest=T, early_table=T), K(64, 4, 2, early_table=T),
                 K(64, 4, 3, heads_fastest=T, early_table=T, pdl=T), K(64, 4, 3, early_table=T, pdl=T),
                 K(32, 4, 6, T, heads_fastest=T), K(32, 4, 6, T, pdl=T)]


@dataclasses.dataclass(frozen=True)
class Mode:
    """One kind of sweep: what it times, and whether it is an A/B (`knob`: the row field or config flag
    compared, refined by do_bench on each side) or the full sweep (refine with PDL, host rows, stage 2)."""
    help: str                   # the --flag's help (the full sweep runs when no flag is given)
    configs: list
    splits: dict                # (B, L) -> split counts
    knob: str | None = None
    workspaces: tuple = (False,)
    block_size_rows: bool = True
    full: bool = False


MODES = {
    "full": Mode("every config and split count, refined with PDL and do_bench", CONFIGS, SPLITS, full=True),
    "final": Mode("only the short list of finalists, no refine pass", FINAL_CONFIGS, SPLITS),
    "deep": Mode("deep-pipeline configs at few splits, no refine pass", DEEP_CONFIGS, DEEP_SPLITS,
                 block_size_rows=False),
    "merge": Mode("in-launch merge (workspace) vs stage-2 launch at the split shapes, do_bench refine",
                  MERGE_CONFIGS, MERGE_SPLITS, "workspace", (False, True), block_size_rows=False),
    "offsets": Mode("int32 cache offsets off vs on, shipped configs with a workspace, do_bench refine",
                    OFFSET_CONFIGS, OFFSET_SPLITS, "offsets_32", (True,)),
    "evict": Mode("register prefetch + evict-first loads vs the shipped configs, with a workspace",
                  EVICT_CONFIGS, EVICT_SPLITS, "reg_prefetch", (True,), block_size_rows=False),
    "hint": Mode("evict-first hint on the cp.async pipeline off vs on, shipped configs, workspace",
                 HINT_CONFIGS, HINT_SPLITS, "evict_first", (True,)),
    "hint_deep": Mode("configs and split counts with the evict-first hint at the single-sequence shapes",
                      HINT_DEEP_CONFIGS, HINT_DEEP_SPLITS, "evict_first", (True,), block_size_rows=False),
    "pdl_wait": Mode("stage 1 launched with PDL off vs on, shipped configs, heuristic splits, workspace",
                     PDL_WAIT_CONFIGS, PDL_WAIT_SPLITS, "pdl_wait", (True,), block_size_rows=False),
    "single_wave": Mode("one sequence at ~1 program per SM with deeper pipelines vs 27 splits, GPU-only",
                        SINGLE_WAVE_CONFIGS, SINGLE_WAVE_SPLITS, workspaces=(True,), block_size_rows=False),
    "stock_ptxas": Mode("register prefetch + evict-first vs the split config, for a ptxas dropping the hint",
                        STOCK_PTXAS_CONFIGS, STOCK_PTXAS_SPLITS, "reg_prefetch", (True,),
                        block_size_rows=False),
    "lean": Mode("shallow pipelines (fewer bytes in flight) at more splits vs the split config, GPU-only",
                 LEAN_CONFIGS, LEAN_SPLITS, workspaces=(True,), block_size_rows=False),
    "split_rule": Mode("split counts of the 1.7-programs-per-SM rule vs one full wave, GPU-only",
                       SPLIT_RULE_CONFIGS, SPLIT_RULE_SPLITS, workspaces=(True,), block_size_rows=False),
}


def _refined(mode: Mode, shape: Shape, rows) -> list[dict]:
    return refine(shape, rows) if mode.full else refine_ab(shape, rows, mode.knob) if mode.knob else []


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--budget-s", type=float, default=360)
    ap.add_argument("--layouts", default="token", help="comma list of KV layouts: token, head")
    for name, mode in MODES.items():
        if name != "full":
            ap.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=mode.help)
    args = ap.parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.budget_s
    chosen = [m for m in MODES if m != "full" and getattr(args, m)]
    mode = MODES[chosen[0] if chosen else "full"]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shapes": []}
    for layout in args.layouts.split(","):
        for (b, ctx), splits in mode.splits.items():
            shape = Shape(b, ctx, 16, layout)
            rows = sweep_shape(shape, splits, mode.configs, deadline, mode.workspaces)
            entry = {"B": b, "L": ctx, "block_size": 16, "layout": layout, "sweep": rows,
                     "refined": _refined(mode, shape, rows)}
            if mode.full:
                entry.update(host_row(shape))
            result["shapes"].append(entry)
            best = min(r["gpu_us"] for r in rows)
            print(f"[{time.time() - t0:5.0f}s] {layout} {b}x{ctx}: best {best:.1f} us", flush=True)
            del shape
            torch.cuda.empty_cache()
        for b, ctx, bs in (BLOCK_SIZE_ROWS if mode.block_size_rows else []):
            shape = Shape(b, ctx, bs, layout)
            rows = sweep_shape(shape, (1,), mode.configs, deadline)
            result["shapes"].append({"B": b, "L": ctx, "block_size": bs, "layout": layout, "sweep": rows,
                                     "refined": _refined(mode, shape, rows)})
            del shape
            torch.cuda.empty_cache()
    if mode.full:
        result["stage2_alone_us"] = {f"{b}x{s}": stage2_alone_us(b, s)
                                     for b, s in ((1, 16), (1, 32), (16, 4))}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "tune.json").write_text(json.dumps(result, indent=1))
    print(ab_table(result, mode.knob) if mode.knob else table(result))
    if mode.full:
        print("stage 2 alone, GPU-only us (batch x splits):", result["stage2_alone_us"])


def table(result) -> str:
    lines = ["lay   B     L      bs  best gpu-only (cfg, splits)              do_bench best      "
             "public host/dobench  sdpa host/dobench/gpu"]
    for e in result["shapes"]:
        if not e["sweep"]:
            continue
        g = min(e["sweep"], key=lambda r: r["gpu_us"])
        d = min(e["refined"], key=lambda r: r["do_bench_us"]) if e["refined"] else None
        cfg = _cfg_name(g["config"])
        dcfg = f"{d['do_bench_us']:.1f} ({_cfg_name(d['config'])}, {d['splits']})" if d else "-"
        host = (f"{e['public_host_us']:.1f}/{e['public_do_bench_us']:.1f}" if "public_host_us" in e else "-")
        sd = (f"{e['sdpa_host_us']:.1f}/{e['sdpa_do_bench_us']:.1f}/{e['sdpa_gpu_us']:.1f}"
              if "sdpa_host_us" in e else "-")
        lines.append(f"{e.get('layout', 'token')[:5]:5} {e['B']:<5} {e['L']:<6} {e['block_size']:<3} "
                     f"{g['gpu_us']:7.1f} "
                     f"({cfg}, {g['splits']}){'':8} {dcfg:30} {host:20} {sd}")
    return "\n".join(lines)


def _cfg_name(c: dict) -> str:
    """KernelConfig.label of a config stored as a dict (older tune files lack the newer flags)."""
    return K(**c).label()


def ab_table(result, knob: str) -> str:
    """Per shape, the best of each side of the A/B: GPU-only (cfg, splits) and its best do_bench."""
    lines = [f"B     L      bs  {knob} off: gpu-only (cfg, s) / do_bench{'':17}"
             "on: gpu-only (cfg, s) / do_bench"]
    for e in result["shapes"]:
        cells = []
        for side in (False, True):
            rows = [r for r in e["sweep"]
                    if _side(r, knob) == side or (knob == "workspace" and r["splits"] == 1)]
            refined = [r for r in e["refined"] if _side(r, knob) == side]
            if not rows:
                cells.append("-")
                continue
            g = min(rows, key=lambda r: r["gpu_us"])
            d = min((r["do_bench_us"] for r in refined), default=float("nan"))
            cells.append(f"{g['gpu_us']:6.1f} ({_cfg_name(g['config'])}, {g['splits']}) / {d:6.1f}")
        lines.append(f"{e['B']:<5} {e['L']:<6} {e['block_size']:<3} {cells[0]:45} {cells[1]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
