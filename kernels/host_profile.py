"""Where the host time of one paged-decode call goes (not a test): `python -m kernels.host_profile`.

At small decode shapes the GPU finishes before the CPU has launched the next call, so per-call host time is
what a caller sees. Times back-to-back calls (no sync inside the loop) of: the public wrapper, the Triton
wrapper alone, torch SDPA on contiguous KV, and an empty torch op (the floor), then writes a cProfile
listing of the public wrapper's hottest functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import paged_decode_attention
from kernels.benchmark import host_us
from kernels.paged_decode import paged_decode_attention_triton
from kernels.testing import make_paged_case


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args(argv)
    case = make_paged_case([args.ctx], 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda", seed=0)
    q4 = case.q.unsqueeze(2)
    k = case.k_cache[case.block_tables.long()].flatten(1, 2)[:, : args.ctx].transpose(1, 2)
    v = case.v_cache[case.block_tables.long()].flatten(1, 2)[:, : args.ctx].transpose(1, 2)
    inputs = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    out = torch.empty_like(case.q)
    calls = {
        "public wrapper": lambda: paged_decode_attention(*inputs),
        "public wrapper, out=": lambda: paged_decode_attention(*inputs, out=out),
        "triton wrapper": lambda: paged_decode_attention_triton(*inputs),
        "triton wrapper, 1 split": lambda: paged_decode_attention_triton(*inputs, num_splits=1),
        "sdpa contiguous": lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True),
        "empty_like (floor)": lambda: torch.empty_like(case.q),
    }
    rows = [(name, host_us(fn, n=2000)) for name, fn in calls.items()]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        paged_decode_attention(*inputs)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    if args.out:
        Path(args.out, "host_profile.txt").write_text(text.getvalue())
    print(text.getvalue()[:3000])
    print(f"host µs per call, B=1 L={args.ctx} Hq32/Hkv8/D128 bf16 ({torch.cuda.get_device_name()})")
    for name, us in rows:
        print(f"  {name:28s} {us:7.1f}")


if __name__ == "__main__":
    main()
