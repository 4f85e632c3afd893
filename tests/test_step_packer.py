"""StepPacker: one step's int32 sections in one buffer, each back intact and 16-byte aligned (Triton
specializes pointer arguments on 16-byte alignment: a section at a varying offset would recompile kernels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.engine.batch_state import StepPacker


@pytest.mark.parametrize("sizes", [[1, 2, 3, 5, 7], [0, 0, 4], [13], [3, 0, 0, 9, 1], []])
def test_sections_come_back_intact_and_aligned(sizes):
    packer = StepPacker(torch.device("cpu"), capacity=8)  # small: the buffer grows
    rng = np.random.default_rng(len(sizes))
    for _ in range(3):  # the two buffers alternate; each reuse must not leak the previous step's values
        sections = [rng.integers(-2**31, 2**31 - 1, n, dtype=np.int64).astype(np.int32) for n in sizes]
        out = packer.send([s.tolist() if i % 2 else s for i, s in enumerate(sections)])
        assert [t.numel() for t in out] == sizes
        for got, want in zip(out, sections, strict=True):
            assert got.dtype == torch.int32
            assert got.tolist() == want.tolist()
            assert got.data_ptr() % 16 == 0
