"""Hardware counters for one decode call, ours vs SDPA (not a test): run under Nsight Compute, e.g.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --csv python -m kernels.ncu_probe 16x4096 64x2048

Each shape is built and warmed up outside the profiled range; then one call of ours (the public
kernels.paged_decode_attention) and one of torch SDPA on the contiguous copy run between cudaProfilerStart
and cudaProfilerStop, under NVTX ranges naming the shape and the method.
"""

from __future__ import annotations

import csv
import sys

import torch

from kernels.benchmark import Shape

METRICS = ("Duration", "DRAM Throughput", "Memory Throughput", "Registers Per Thread", "Grid Size",
           "Block Limit Shared Mem", "Block Limit Registers", "Theoretical Occupancy", "Achieved Occupancy",
           "Waves Per SM", "Warp Cycles Per Issued Instruction")


def summarize(path: str) -> None:
    """`python -m kernels.ncu_probe --summarize ncu.csv`: the metrics above, one line per kernel launch."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(line for line in f if line.startswith('"'))]
    launches: dict = {}
    for r in rows:
        if r.get("Metric Name") in METRICS:
            key = (r["ID"], r["Kernel Name"][:40])
            launches.setdefault(key, {})[r["Metric Name"]] = f"{r['Metric Value']} {r.get('Metric Unit', '')}"
    for (launch_id, name), vals in launches.items():
        print(f"{launch_id:>3} {name:40s} " + "; ".join(f"{m}={vals[m]}" for m in METRICS if m in vals))


def main(argv=None) -> None:
    argv = argv if argv is not None else sys.argv[1:]
    if argv[:1] == ["--summarize"]:
        summarize(argv[1])
        return
    specs = argv or ["16x4096", "64x2048"]
    shapes = []
    for spec in specs:
        batch, ctx = (int(x) for x in spec.split("x"))
        shape = Shape(batch, ctx, 16)
        shape.ours()
        shape.sdpa_contig()
        shapes.append((spec, shape))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for spec, shape in shapes:
        for name, fn in (("ours", shape.ours), ("sdpa", shape.sdpa_contig)):
            torch.cuda.nvtx.range_push(f"{spec} {name}")
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
