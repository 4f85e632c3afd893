"""Which allocations of a fresh core's first closed loop take new device segments (GPU, a probe, not a
test): `python -m tools.alloc_trace [--concurrency 256] [--out DIR]`.

The core is built as tools/closed_loop_stalls builds it; torch's memory history records the first loop
(C requests of 512 in / 128 out kept in flight); every segment_alloc event is printed with its size and the
innermost frames of this repository that asked for it. Prints a table last; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from server.engine.engine import EngineConfig, build_core
from tools.engine_step_bench import closed_loop

REPO = str(Path(__file__).resolve().parents[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    core, _ = build_core(EngineConfig(model="bench", device="cuda", dtype="bfloat16", max_num_seqs=256,
                                      max_num_batched_tokens=8192, gpu_memory_utilization=0.8))
    core.async_scheduling = True
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    r = closed_loop(core, args.concurrency, args.num_requests, 512, 128)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    rows = []
    for device_trace in snapshot["device_traces"]:
        for e in device_trace:
            if e["action"] != "segment_alloc":
                continue
            frames = [f"{f['filename'].replace(REPO + '/', '')}:{f['line']} {f['name']}"
                      for f in e.get("frames", []) if REPO in f["filename"]]
            rows.append({"mib": e["size"] / 2**20, "stream": e.get("stream"), "frames": frames[:6]})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alloc_trace.json").write_text(json.dumps({"tok_s": r["tok_s"], "segments": rows}, indent=1))
    print(f"closed loop {args.concurrency}:{args.num_requests}: {r['tok_s']:.0f} tok/s, "
          f"{len(rows)} new segments")
    for row in rows:
        print(f"{row['mib']:9.1f} MiB stream {row['stream']}: " + " <- ".join(row["frames"][:4]))


if __name__ == "__main__":
    main()
