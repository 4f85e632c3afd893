"""The step-inputs kernel against BatchState's torch derivation (its reference), on the Triton interpreter:
decode rows, prefill tokens, padding (position -1), pending ids (-1), a device decode count, odd sizes, and
outputs poisoned before each run."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kernels.step_inputs import BLOCK, step_inputs
from server.engine.batch_state import TOKEN_FIELDS, BatchState

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1")


def random_state(rows: int, width: int, block_size: int, seed: int) -> BatchState:
    state = BatchState(rows, width, block_size, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    state.block_tables[:rows] = torch.randint(1, 10_000, (rows, width), generator=gen, dtype=torch.int32)
    state.last_token[:] = torch.randint(3, 50_000, (rows + 1,), generator=gen)
    return state


def random_tokens(state: BatchState, num_tokens: int, num_pad: int, seed: int) -> torch.Tensor:
    """(3, T): random rows, positions inside the tables, ids of which ~1/3 pending (-1); then padding."""
    rng = random.Random(seed)
    cap = state.max_blocks * state.block_size
    real = num_tokens - num_pad
    rows = [rng.randrange(state.max_rows) for _ in range(real)] + [state.pad_row] * num_pad
    pos = [rng.randrange(cap) for _ in range(real)] + [-1] * num_pad
    ids = [-1 if rng.random() < 0.34 else rng.randrange(3, 50_000) for _ in range(real)] + [0] * num_pad
    return torch.tensor([rows, pos, ids], dtype=torch.int32)


def poison_empty(monkeypatch):
    """torch.empty returns tensors filled with a sentinel: an element the kernel misses keeps it."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(-7777)

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("num_tokens,num_decode_rows,num_pad,block_size", [
    (1, 1, 0, 16), (7, 3, 2, 16), (9, 9, 4, 16), (BLOCK + 5, BLOCK + 5, 9, 1), (2 * BLOCK, 2 * BLOCK, 0, 128),
    (33, 0, 5, 16),
])
@pytest.mark.parametrize("count", [None, 0, 2])
def test_step_inputs_match_the_torch_derivation(monkeypatch, num_tokens, num_decode_rows, num_pad, block_size,
                                                count):
    state = random_state(rows=24, width=9, block_size=block_size, seed=num_tokens)
    tokens = random_tokens(state, num_tokens, num_pad, seed=num_tokens + num_pad)
    assert tokens.shape == (TOKEN_FIELDS, num_tokens)
    decode_count = None if count is None else torch.tensor([count], dtype=torch.int32)
    want = state._derive(tokens, num_decode_rows, decode_count)
    poison_empty(monkeypatch)
    got = step_inputs(tokens, state.last_token, state.block_tables, block_size, num_decode_rows, decode_count)
    names = ("input_ids", "positions", "slots", "seq_lens")
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name
    assert (got[2][num_tokens - num_pad:] == -1).all()  # padding writes no KV


@pytest.mark.parametrize("num_tokens,num_pad", [(1, 0), (7, 2), (BLOCK + 5, 9)])
@pytest.mark.parametrize("kernel", [False, True])
def test_advance_leaves_the_next_decode_steps_tokens(num_tokens, num_pad, kernel):
    """With advance the outputs are unchanged and the tokens become what the same rows' next decode step
    packs: positions one on, ids -1 (pending: the device's last token), padding and rows untouched."""
    state = random_state(rows=24, width=9, block_size=16, seed=num_tokens)
    state.kernel_inputs = kernel
    tokens = random_tokens(state, num_tokens, num_pad, seed=num_tokens)
    before = tokens.clone()
    want = state._derive(before, num_tokens, None)
    ids, pos, meta = state.step_inputs(tokens, num_tokens, advance=True)
    assert torch.equal(ids, want[0]) and torch.equal(pos, want[1])
    assert torch.equal(meta.slot_mapping, want[2]) and torch.equal(meta.seq_lens, want[3])
    real = num_tokens - num_pad
    assert torch.equal(tokens[0], before[0])
    assert torch.equal(tokens[1, :real], before[1, :real] + 1) and (tokens[2, :real] == -1).all()
    assert torch.equal(tokens[:, real:], before[:, real:])


def test_step_inputs_metadata_is_the_same_through_either_path():
    """BatchState.step_inputs with the kernel gives the metadata the torch path gives (chunks included)."""
    state = random_state(rows=8, width=5, block_size=16, seed=3)
    tokens = random_tokens(state, 12, 3, seed=4)
    chunks = (torch.tensor([1, 5], dtype=torch.int32), torch.tensor([4, 6, 9], dtype=torch.int32),
              torch.tensor([20, 33], dtype=torch.int32))
    outs = []
    for kernel in (False, True):
        state.kernel_inputs = kernel
        outs.append(state.step_inputs(tokens, 4, torch.tensor([3], dtype=torch.int32), chunks))
    (ids0, pos0, m0), (ids1, pos1, m1) = outs
    assert torch.equal(ids0, ids1) and torch.equal(pos0, pos1)
    assert torch.equal(m0.slot_mapping, m1.slot_mapping) and torch.equal(m0.seq_lens, m1.seq_lens)
    assert torch.equal(m0.block_tables, m1.block_tables) and m0.num_decode == m1.num_decode == 4
    assert torch.equal(m0.prefill.block_tables, m1.prefill.block_tables)


def test_step_inputs_rejects_what_it_cannot_read():
    state = random_state(rows=4, width=3, block_size=16, seed=0)
    with pytest.raises(ValueError, match="int32"):
        step_inputs(torch.zeros(3, 4, dtype=torch.int64), state.last_token, state.block_tables, 16, 1)
    with pytest.raises(ValueError, match="num_decode_rows"):
        step_inputs(torch.zeros(3, 4, dtype=torch.int32), state.last_token, state.block_tables, 16, 5)
