"""Cheaper host-side launches of @triton.jit kernels.

Triton's JIT re-binds and re-specialises every argument on each call. On the H200 machine (triton 3.6,
a slow VM CPU) one paged-decode call (two launches, ~40 arguments each) cost ~121 µs of host time through
the JIT against ~23-32 µs for a whole SDPA call; at small decode shapes that is longer than the kernels.
The first call with a given specialisation goes through the JIT (compiling if needed); its CompiledKernel is
kept under a key that covers everything Triton specialises on (dtypes, 16-byte pointer alignment, exact
integer/float values, constexprs, warps, stages, device), and later calls launch it directly."""

from __future__ import annotations

import os


class CachedLauncher:
    """launcher(grid, *args, num_warps=, num_stages=, **constexprs) for one @triton.jit function whose first
    `num_tensors` parameters are tensors and the rest of the positional ones ints/floats."""

    def __init__(self, fn, num_tensors: int):
        self.fn = fn
        self.num_tensors = num_tensors
        self.compiled = {}
        self.direct_ok = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

    def __call__(self, grid, *args, num_warps, num_stages, **constexprs):
        if not (self.direct_ok and args[0].is_cuda):
            return self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        tensors = args[:self.num_tensors]
        key = (tuple(t.dtype for t in tensors), tuple(t.data_ptr() % 16 == 0 for t in tensors),
               args[self.num_tensors:], tuple(constexprs.values()), num_warps, num_stages,
               args[0].get_device())
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
            self.compiled[key] = kernel
            return kernel
        # the launcher takes every parameter in definition order and drops the constexprs itself
        tail = [constexprs[name] for name in self.fn.arg_names[len(args):]]
        kernel[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)      # the runner wants a 3-d grid
        return kernel
