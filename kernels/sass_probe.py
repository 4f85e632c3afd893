"""Offline look at the compiled decode kernel (not a test; no GPU needed): `python -m kernels.sass_probe`.

    python -m kernels.sass_probe --shape 1x32768 [--splits N] [--config 64,4,3] [--flags heads_fastest,...]
                                 [--workspace] [--dtype bf16] [--arch 90] [--sms 132] [--dump DIR] [--json]

Builds the stage-1 launch exactly as a CUDA call of that shape would (the heuristic's split count for --sms
SMs and the config table's tile config, unless given), compiles it for sm_<arch> with Triton's own ptxas, and
prints registers, spilled bytes, shared memory and the instruction mix of the tile loop (the SASS loop that
holds the tensor-core instructions). So a change to the loop can be counted before device time is spent on
it (docs/kernel_notes.md runs 18, 19 and 23). --dump DIR writes the TTGIR, PTX and SASS. Needs the Triton
build with the NVIDIA backend (its bin/ has ptxas and cuobjdump) and TRITON_INTERPRET unset. The code
depends on the Triton version: to reason about the GPU machine's kernels, run it under that machine's Triton
(3.6 there; `pip install triton==3.6.0` into a separate venv here).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from kernels import l2_hint
from kernels.l2_hint import cp_async_counts
from kernels.paged_decode import NO_WINDOW, _DecodePlan, _paged_decode_stage1
from kernels.split_heuristic import KernelConfig, choose_launch
from kernels.workspace import DecodeWorkspace

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class _TargetOnly:
    """Stands in for Triton's CUDA driver while compiling: it names the target; nothing is launched."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _inputs(batch, ctx, hq, hkv, d, block_size, dtype):
    """CPU tensors with the shapes and strides of the call: q (B, Hq, D), caches (N, bs, Hkv, D), table."""
    n_blocks = batch * -(-ctx // block_size) + 1
    q = torch.empty(batch, hq, d, dtype=dtype)
    k = torch.empty(n_blocks, block_size, hkv, d, dtype=dtype)
    table = torch.empty(batch, -(-ctx // block_size), dtype=torch.int32)
    return q, k, torch.empty_like(k), table, torch.full((batch,), ctx, dtype=torch.int32)


def compile_stage1(batch, ctx, hq=32, hkv=8, d=128, block_size=16, dtype=torch.bfloat16, splits=None,
                   config: KernelConfig | None = None, workspace=False, arch=90, sms=132):
    """(compiled kernel, plan) for the stage-1 launch a CUDA call of this shape would make."""
    q, k, v, table, seq_lens = _inputs(batch, ctx, hq, hkv, d, block_size, dtype)
    cfg, splits = choose_launch(torch.device("cuda"), batch, hkv, table.shape[1] * block_size, d,
                                q.element_size(), block_size, sms, l2_hint.cp_async_hint_compiles(arch),
                                splits or None, config)
    plan = _DecodePlan(q, k, v, table, None, d ** -0.5, NO_WINDOW, splits, cfg, workspace, True)
    plan.kw1["USE_PDL"] = cfg.pdl and not (plan.one or plan.fused)   # the plan turns PDL off off-CUDA
    plan.kw1["PDL_WAIT"] = cfg.pdl_wait
    part = torch.empty(max(plan.part_numel, 1))
    tickets = DecodeWorkspace(batch, hkv, "cpu").tickets if plan.fused else q
    args = (q, k, v, table, seq_lens, part, part, q, tickets, *plan.ints1)
    driver.set_active(_TargetOnly(arch))
    try:
        kernel = _paged_decode_stage1.warmup(*args, grid=(1,), **plan.kw1)
    finally:
        try:
            driver.reset_active()
        except RuntimeError:       # no GPU driver in this process (the usual case here): the stub stays
            pass
    return kernel, plan


def _sass_lines(cubin: Path) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction in the cubin."""
    text = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    found = (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in text.splitlines())
    return [(int(m.group(1), 16), m.group(2)) for m in found if m]


def _opcode(instr: str) -> str:
    words = instr.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def tile_loop_mix(instrs) -> collections.Counter:
    """Opcode counts of the innermost loop holding tensor-core (HMMA) instructions: the K/V tile loop."""
    loops = []
    for addr, text in instrs:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in instrs if int(m.group(1), 16) <= a <= addr]
            mix = collections.Counter(_opcode(t) for t in body)
            if mix["HMMA"]:
                loops.append(mix)
    return min(loops, key=lambda c: sum(c.values()), default=collections.Counter())


def report(kernel, plan, dump: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "stage1.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        instrs = _sass_lines(cubin)
    res = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (dump / f"stage1.{ext}").write_text(kernel.asm[ext])
        (dump / "stage1.sass").write_text("\n".join(t for _, t in instrs))
    loop = tile_loop_mix(instrs)
    copies, hinted = cp_async_counts(kernel.asm["ptx"])
    return {"registers": int(res.group(1)), "stack_bytes": int(res.group(2)),
            "cp_async_16": copies, "cp_async_l2_hint": hinted,
            "shared_bytes": kernel.metadata.shared, "instructions": len(instrs),
            "tile_loop_instructions": sum(loop.values()), "tile_loop_mix": dict(loop.most_common()),
            "splits": plan.ints1[2], "fused_merge": plan.fused,
            "constexprs": {k: v for k, v in plan.kw1.items() if isinstance(v, (bool, int, str))}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x32768", help="BATCHxCONTEXT")
    ap.add_argument("--heads", default="32/8", help="Hq/Hkv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--splits", type=int, default=None)
    ap.add_argument("--config", default=None, help="block_n,num_warps,num_stages (default: the config table)")
    ap.add_argument("--flags", default="", help="with --config: KernelConfig flags, e.g. heads_fastest,pdl")
    ap.add_argument("--workspace", action="store_true", help="the in-launch merge of a DecodeWorkspace")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--dump", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    batch, ctx = (int(x) for x in args.shape.split("x"))
    hq, hkv = (int(x) for x in args.heads.split("/"))
    config = None
    if args.config:  # flags: "name" sets a KernelConfig flag, "name=0" clears it (e.g. offsets_32=0)
        flags = dict(f.split("=") if "=" in f else (f, "1") for f in args.flags.split(",") if f)
        config = KernelConfig(*(int(x) for x in args.config.split(",")),
                              **{k: v != "0" for k, v in flags.items()})
    kernel, plan = compile_stage1(batch, ctx, hq, hkv, args.head_dim, args.block_size, DTYPES[args.dtype],
                                  args.splits, config, args.workspace, args.arch, args.sms)
    rep = report(kernel, plan, args.dump)
    rep["config"] = dataclasses.asdict(config) if config else "table"
    if args.json:
        print(json.dumps(rep))
        return
    mix = " ".join(f"{op}:{n}" for op, n in list(rep["tile_loop_mix"].items())[:20])
    print(f"sm_{args.arch} {args.shape} {args.dtype}, {rep['splits']} splits: {rep['registers']} registers, "
          f"{rep['stack_bytes']} B stack, {rep['shared_bytes']} B shared, {rep['instructions']} "
          f"instructions; tile loop {rep['tile_loop_instructions']}: {mix}")


if __name__ == "__main__":
    main()
