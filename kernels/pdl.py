"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the
kernel before it on the stream is still running, once that one has executed `gdc_launch_dependents`
(griddepcontrol.launch_dependents) in every program, or finished.

The contract of every kernel here that takes `USE_GDC`: it calls `gdc_launch_dependents` first (its own
successor may launch), and `gdc_wait` (griddepcontrol.wait: the kernel before it has finished, and so has
every kernel before that, their writes visible) before it writes anything or reads anything but weights.
The GEMVs (kernels/gemv.py) load their weight tiles before the wait, which is where the overlap pays; a
CUDA graph keeps the launches' programmatic edges (measured there and in docs/kernel.md).
Not used by the decode attention: launched this way (waiting first, letting the next GEMV launch at once)
it made the batch-1 step slower, 0.894 ms against 0.870 on an H200 (tools/decode_forward_bench, two calls,
the GEMM route 1.095 / 1.092 in each): the o_proj GEMV's early programs compete with attention's few.
Nor with the wait first and the next launch allowed only after the tile loop: 0.930 ms against 0.871 for the
plain launch in one call (2026-12-02, the plain kernel swapped back in for the second run); nor letting the
o_proj GEMV launch at the attention's start (0.916 against 0.879), nor waiting first with no early successor
(0.895 against 0.876): docs/kernel.md, "Filling the attention's idle bandwidth". Nor by the kernels above one
row (RoPE + store and SiLU-and-mul waiting first behind their cuBLAS GEMMs, the split-K down projection behind
SiLU-and-mul): -0.9% at 64 rows, +0.3% at 256 on an H100, and slower still with the down projection's weights
prefetched into L2 before its wait (docs/kernel.md, "Programmatic launch for the decoder's own kernels").
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False  # the interpreter runs programs one by one: nothing to overlap, no griddepcontrol
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def uses_pdl(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch (compiled code on sm_90+)."""
    return device.type == "cuda" and _supported(device.index if device.index is not None else 0)


def pdl_options(device: torch.device) -> dict:
    """The kernel arguments of a launch on `device`: USE_GDC, and the launch_pdl option where it is True."""
    on = uses_pdl(device)
    return {"USE_GDC": on, "launch_pdl": True} if on else {"USE_GDC": False}
