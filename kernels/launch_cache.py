"""Cheap host-side launches of @triton.jit kernels.

Triton's JIT re-binds and re-specialises every argument on each call. Measured on the H200 machine
(triton 3.6): ~120 µs of host time for one paged-decode call (two launches, ~40 arguments each) against
~23 µs for a whole SDPA call, which at small decode shapes is longer than the kernels themselves. The first
call with a given specialisation goes through the JIT (compiling if needed); its CompiledKernel is kept
under a key that covers everything Triton specialises on (dtypes, 16-byte pointer alignment, exact integer
values, constexprs, warps, stages, device), and later calls launch it directly.
"""

from __future__ import annotations

import os

import torch


def _arg_key(arg):
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, float):
        return float
    return arg


class CachedLauncher:
    """launcher(grid, *args, num_warps=, num_stages=, **constexprs) for one @triton.jit function."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = {}
        self.direct_ok = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

    def __call__(self, grid, *args, num_warps, num_stages, **constexprs):
        if not (self.direct_ok and args[0].is_cuda):
            return self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        key = (tuple(map(_arg_key, args)), tuple(constexprs.values()), num_warps, num_stages,
               args[0].device.index)
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
            self.compiled[key] = kernel
            return kernel
        # the launcher takes every parameter in definition order and drops the constexprs itself
        tail = [constexprs[name] for name in self.fn.arg_names[len(args):]]
        kernel[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)      # the runner wants a 3-d grid
        return kernel
