"""Cheaper host-side launches of @triton.jit kernels.

Triton's JIT re-binds and re-specialises every argument on each call, and its CompiledKernel runner builds
launch metadata and runs the launch-hook chain on every launch; at small decode shapes that host time is
longer than the kernels themselves (docs/kernel.md gives the per-call host time of both paths).

`CompiledLaunch` binds one CompiledKernel for direct launches. The direct path fails closed: it calls the C
launch function with the raw stream and no hooks only on the Triton versions whose launcher argument layout
was read and verified (_VERIFIED_LAUNCHER; tests/test_gpu_kernels.py checks its outputs equal the public
path's), and only while no launch hook is installed (e.g. a profiler); everywhere else it goes through the
CompiledKernel's own runner, the public path. `CachedLauncher` keeps compiled kernels under a key covering
everything Triton specialises on (dtypes, 16-byte pointer alignment, integer values, constexprs, warps,
stages, device).
"""

from __future__ import annotations

import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

# triton versions whose CompiledKernel.run is a CudaLauncher with .launch(gridX, gridY, gridZ, stream,
# function, cooperative, pdl, global_scratch, profile_scratch, packed_metadata, launch_metadata,
# enter_hook, exit_hook, *args) -- read from triton 3.6.0's nvidia/driver.py and run on the H200.
_VERIFIED_LAUNCHER = ("3.6.",)


def _hooks_installed() -> bool:
    hooks = triton.knobs.runtime
    return bool(getattr(hooks.launch_enter_hook, "calls", hooks.launch_enter_hook)
                or getattr(hooks.launch_exit_hook, "calls", hooks.launch_exit_hook))


class CompiledLaunch:
    """launch(grid3, stream, args): one compiled kernel; args are all parameters in definition order
    (tensors or raw device pointers, ints, floats, and the constexpr values, which the launcher skips)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.direct = None
        run = kernel.run                                    # loads the module on first use
        if (triton.__version__.startswith(_VERIFIED_LAUNCHER) and hasattr(run, "launch")
                and not getattr(run, "global_scratch_size", 1)
                and not getattr(run, "profile_scratch_size", 1)):
            self.direct = (run.launch, kernel.function, run.launch_cooperative_grid, run.launch_pdl,
                           kernel.packed_metadata)

    def __call__(self, grid, stream, args):
        if self.direct is None or _hooks_installed():
            self.kernel[grid](*args, stream=stream)
            return
        launch, function, coop, pdl, packed = self.direct
        launch(grid[0], grid[1], grid[2], stream, function, coop, pdl, None, None, packed, None, None, None,
               *args)


def _tensor_key(t) -> tuple | None:
    """What Triton specialises a tensor argument on: dtype and 16-byte alignment; for a tensor descriptor
    also its tile shape (its sizes and strides are run-time arguments); None stays None (a constexpr)."""
    if t is None:
        return None
    if isinstance(t, TensorDescriptor):
        return ("desc", t.base.dtype, tuple(t.block_shape), t.base.data_ptr() % 16 == 0)
    return (t.dtype, t.data_ptr() % 16 == 0)


def current_stream(device_index: int) -> int:
    """The raw CUDA stream handle Triton launches on: the call Triton's own driver makes to torch, cheaper
    than building a torch.cuda.Stream object per launch."""
    return torch._C._cuda_getCurrentRawStream(device_index)


class CachedLauncher:
    """launcher(grid, *args, num_warps=, num_stages=, **constexprs_and_options) for one @triton.jit function
    whose first `num_tensors` parameters are tensors (or tensor descriptors, or None) and the rest of the
    positional ones ints/floats.
    `launch_pdl=True` (an option, not a constexpr) launches with programmatic dependent launch."""

    def __init__(self, fn, num_tensors: int):
        self.fn = fn
        self.num_tensors = num_tensors
        self.compiled: dict = {}
        self.direct_ok = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

    def compiled_for(self, grid, args, num_warps, num_stages, kw) -> tuple[CompiledLaunch, bool]:
        """(bound kernel for this specialisation, whether this call launched it): a new specialisation is
        compiled and launched once through the JIT."""
        key = self.key(args, num_warps, num_stages, kw)
        bound = self.compiled.get(key)
        if bound is not None:
            return bound, False
        kernel = self.fn[grid](*args, **kw, num_warps=num_warps, num_stages=num_stages)
        bound = self.compiled[key] = CompiledLaunch(kernel)
        return bound, True

    def key(self, args, num_warps, num_stages, kw) -> tuple:
        """What a call's compiled kernel is found under: everything Triton specialises on."""
        return (tuple(_tensor_key(t) for t in args[:self.num_tensors]), args[self.num_tensors:],
                tuple(kw.items()), num_warps, num_stages, args[0].get_device())

    def tail(self, nargs: int, kw: dict) -> list:
        """The constexpr values after the positional args, in definition order (options dropped)."""
        return [kw[name] for name in self.fn.arg_names[nargs:]]

    def __call__(self, grid, *args, num_warps, num_stages, **kw):
        if not (self.direct_ok and args[0].is_cuda):
            return self.fn[grid](*args, **kw, num_warps=num_warps, num_stages=num_stages)
        bound, launched = self.compiled_for(grid, args, num_warps, num_stages, kw)
        if not launched:
            grid3 = tuple(grid) + (1,) * (3 - len(grid))                # the launcher wants a 3-d grid
            bound(grid3, current_stream(args[0].get_device()), (*args, *self.tail(len(args), kw)))
        return bound
