"""The shared-memory buffers Triton gives each pipelined operand of a kernel, compiled offline for sm_90 (no
GPU needed; a CPU box's Triton carries the NVIDIA backend): `python -m tools.ttgir_stages [--probe]`.

Prints, for kernels/gate_up_silu.py's kernel at the 64-row tile (and with --probe the four variants of
tools/gate_up_silu_probe.py), each `ttg.local_alloc` of a multi-buffered operand (its shape: stages first)
and the asynchronous wgmma waits. An operand with fewer buffers than the loads run ahead of the wgmma that
reads it is the hazard docs/kernel.md describes (x had 2 buffers against the weights' 3).
"""

from __future__ import annotations

import argparse
import re

import triton
from triton.backends.compiler import GPUTarget

from kernels.gate_up_silu import _gate_up_silu_kernel
from tools.gate_up_silu_probe import MODES, _variant_kernel

POINTERS = {"X": "*bf16", "W": "*bf16", "OUT": "*bf16"}
SCALARS = {"eps": "fp32", "M": "i32", "K": "i32", "stride_x": "i32", "stride_o": "i32"}
TILES = {"INTERMEDIATE": 8192, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128}


def ttgir(fn, constexprs: dict, num_stages: int = 3) -> str:
    """The TTGIR of @triton.jit `fn` at these constexprs (an interpreted one too: TRITON_INTERPRET=1 makes
    @triton.jit an InterpretedFunction, whose Python function compiles as ever)."""
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = triton.runtime.jit.JITFunction(fn.fn)
    signature = POINTERS | SCALARS | dict.fromkeys(constexprs, "constexpr")
    divisible = [i for i, name in enumerate(signature)
                 if name in ("X", "W", "OUT", "K", "stride_x", "stride_o")]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4,
                                                                           "num_stages": num_stages})
    return kernel.asm["ttgir"]


def buffers(text: str) -> list[tuple[str, str]]:
    """(value, shape) of each multi-buffered operand: the pipeline's stages are the shape's first number."""
    return re.findall(r"(%\w+) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+(?:x\d+)*)x", text)


def summary(text: str) -> list[str]:
    waits = re.findall(r"warp_group_dot_wait .*?\{pendings = (\d+)", text)
    return [f"{name}: {shape}" for name, shape in buffers(text)] + [f"wgmma waits: {', '.join(waits)} left"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", action="store_true", help="the probe's variants too")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm_90, 64-row tile, 3 stages")
    shipped = ttgir(_gate_up_silu_kernel, TILES | {"EVEN": True, "DOT_PRECISION": "tf32"})
    print("gate_up_silu (shipped): " + "; ".join(summary(shipped)))
    for mode, value in MODES.items() if args.probe else ():
        print(f"probe {mode}: " + "; ".join(summary(ttgir(_variant_kernel, TILES | {"MODE": value}))))


if __name__ == "__main__":
    main()
