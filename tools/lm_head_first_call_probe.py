"""The lm_head product's first call at each row count: `python -m tools.lm_head_first_call_probe`.

A fresh process takes the `bench` preset's head shape (vocab 128256 x hidden 2048, bf16, with the bias the
seeded models carry), calls it once at max rows (as the runner's start-up does), then at every row count
1..max in turn, timing each call's host part (the launch, before a synchronize) the first time and again
after all row counts have run once. Printed last: the row counts whose first call's launch took longer than
--slow-ms.
A launch of tens of ms at some new row count (cuBLAS's choice and set-up of a kernel for that shape, host
work with the device idle) is what an eager logits product meets in a server's first burst.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def launch_ms(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> float:
    """One logits product's host time (launch only), the device idle before it."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.linear(hidden, weight, bias).float()
    ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--max-rows", type=int, default=256)
    ap.add_argument("--slow-ms", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=Path("lm_head_first_call.json"))
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    weight = torch.randn(args.vocab, args.hidden, device=dev, dtype=dt) * 0.02
    bias = torch.randn(args.vocab, device=dev, dtype=dt)
    hidden = torch.randn(args.max_rows, args.hidden, device=dev, dtype=dt)
    start_ms = launch_ms(hidden, weight, bias)
    first = {m: launch_ms(hidden[:m], weight, bias) for m in range(1, args.max_rows + 1)}
    again = {m: launch_ms(hidden[:m], weight, bias) for m in range(1, args.max_rows + 1)}
    slow = {m: round(ms, 3) for m, ms in first.items() if ms > args.slow_ms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "cuda": torch.version.cuda, "start_ms": start_ms,
                                    "first_ms": first, "again_ms": again}, indent=1))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"head {args.vocab} x {args.hidden} bf16 with bias; the first call at {args.max_rows} rows: "
          f"{start_ms:.1f} ms")
    print(f"first calls slower than {args.slow_ms} ms: {len(slow)} of {args.max_rows} row counts, "
          f"{sum(slow.values()):.0f} ms in all: {slow}")
    print(f"first calls: median {sorted(first.values())[len(first) // 2]:.3f} ms, max "
          f"{max(first.values()):.1f} ms; again: max {max(again.values()):.3f} ms")


if __name__ == "__main__":
    main()
