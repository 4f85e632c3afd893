"""The shared-memory buffers Triton gives each pipelined operand of a kernel, compiled offline for sm_90 (no
GPU needed; a CPU box's Triton carries the NVIDIA backend): `python -m tools.ttgir_stages [--probe]`.

Prints, for kernels/gate_up_silu.py's and kernels/qkv_rope_store.py's kernels at the 64-row tile (and with
--probe the four variants of tools/gate_up_silu_probe.py), each `ttg.local_alloc` of a multi-buffered
operand (its shape: stages first) and the asynchronous wgmma waits. An operand with fewer buffers than the
loads run ahead of the wgmma that reads it is the hazard docs/kernel.md describes (x had 2 buffers against
the weights' 3).
"""

from __future__ import annotations

import argparse
import re

import triton
from triton.backends.compiler import GPUTarget

from kernels.gate_up_silu import _gate_up_silu_kernel
from kernels.qkv_rope_store import _qkv_rope_store_kernel
from tools.gate_up_silu_probe import MODES, _variant_kernel

TILES = {"INTERMEDIATE": 8192, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128}
# kernels/qkv_rope_store.py's kernel at the bench shape's 64-row tile
QKV_TILES = {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HALF": 32, "HAS_BIAS": False, "BLOCK_M": 64,
             "BLOCK_H": 16, "BLOCK_K": 128, "SPLIT_K": 4, "EVEN_K": True, "DOT_PRECISION": "tf32"}
POINTER_TYPES = {"COS": "*fp32", "SIN": "*fp32", "SLOTS": "*i64", "PART": "*fp32", "TICKETS": "*i32"}
SIZES = ("M", "N", "K")  # upper-case, and i32


def ttgir(fn, constexprs: dict, num_stages: int = 3) -> str:
    """The TTGIR of @triton.jit `fn` at these constexprs (an interpreted one too: TRITON_INTERPRET=1 makes
    @triton.jit an InterpretedFunction, whose Python function compiles as ever). The kernels' convention
    names the signature: upper-case parameters but M, N, K are pointers (16-byte aligned), eps is fp32, the
    rest i32;
    K, k_per_split and the strides but the last dimension's are taken as multiples of 16, as the serving
    shapes are (Triton specialises an integer argument on that; unaligned, the loads are not pipelined)."""
    jit = triton.runtime.jit.JITFunction
    if not isinstance(fn, jit):
        fn = jit(fn.fn)
    # the @triton.jit helpers it calls, interpreted too, compile as JITFunctions for the while
    names = fn.fn.__globals__
    helpers = {name: f for name, f in names.items() if type(f).__name__ == "InterpretedFunction"}
    signature = {name: _type_of(name, constexprs) for name in fn.arg_names}
    divisible = [i for i, name in enumerate(signature) if signature[name].startswith("*")
                 or name in ("K", "k_per_split") or (name.startswith("stride_") and not name.endswith("d"))]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    try:
        names.update({name: jit(f.fn) for name, f in helpers.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4,
                                                                               "num_stages": num_stages})
    finally:
        names.update(helpers)
    return kernel.asm["ttgir"]


def _type_of(name: str, constexprs: dict) -> str:
    if name in constexprs:
        return "constexpr"
    if name.isupper() and name not in SIZES:
        return POINTER_TYPES.get(name, "*bf16")
    return "fp32" if name == "eps" else "i32"


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
    print("qkv_rope_store (shipped): " + "; ".join(summary(ttgir(_qkv_rope_store_kernel, QKV_TILES))))
    for mode, value in MODES.items() if args.probe else ():
        print(f"probe {mode}: " + "; ".join(summary(ttgir(_variant_kernel, TILES | {"MODE": value}))))


if __name__ == "__main__":
    main()
