"""Captured mixed steps, the parts that run on CPU: the token-count buckets, the flat-batch layout, and the
static-buffer replay path (MixedGraphs with use_cuda_graphs=False: padded tokens, spare decode rows that read
nothing, empty padding chunks, the chunks' rows found from query_start_loc in the whole flat batch) against
an eager runner fed the same steps. tests/test_runner_gpu.py runs the comparison with real graphs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from runner_chunks import Chunk, run_chunks

from server.engine.batch_state import FlatLayout, StepPacker
from server.engine.cuda_graphs import MAX_MIXED_TOKENS, mixed_sizes
from server.engine.runner import ModelRunner
from server.model import load_model

BS = 4


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", "cpu", torch.float32)
    return model


@pytest.mark.parametrize("budget, sizes", [
    (8, [8]),
    (16, [16]),
    (100, [16, 32, 64, 100]),
    (512, [16, 32, 64, *range(128, 513, 64)]),
    (1000, [16, 32, 64, *range(128, 961, 64), 1000]),
    (3000, [16, 32, 64, *range(128, 1025, 64), *range(1152, 2049, 128), *range(2304, 2817, 256), 3000]),
    (1 << 20, [16, 32, 64, *range(128, 1025, 64), *range(1152, 2049, 128), *range(2304, 4097, 256),
               *range(4608, 8193, 512)]),
])
def test_mixed_sizes(budget, sizes):
    assert mixed_sizes(budget) == sizes and sizes[-1] <= MAX_MIXED_TOKENS
    padding = [(b - a - 1) / b for a, b in zip(sizes, sizes[1:], strict=False) if a >= 256]
    assert all(p < 0.2 for p in padding)  # the worst padding of a step of 320+ tokens


@pytest.mark.parametrize("tokens, chunks, out", [(1, 0, 0), (5, 3, 2), (16, 16, 16), (7, 1, 3)])
def test_flat_layout_round_trips_and_aligns_every_part(tokens, chunks, out):
    layout = FlatLayout(tokens, chunks, out)
    rng = np.random.default_rng(tokens * 31 + chunks)
    parts = [rng.integers(-1, 100, n).tolist() for n in (tokens, tokens, tokens, chunks, chunks + 1, chunks)]
    out_rows = rng.integers(0, tokens, max(out - 1, 0)).tolist()  # one short: the rest pads with row 0
    flat = torch.from_numpy(layout.pack(*parts, num_decode=4, out_rows=out_rows))
    assert flat.shape == (layout.length,)
    toks, rows, qsl, lens, nd, outs = layout.views(flat)
    assert toks.tolist() == parts[:3] and rows.tolist() == parts[3] and qsl.tolist() == parts[4]
    assert lens.tolist() == parts[5] and nd.tolist() == [4]
    assert outs.tolist() == (out_rows + [0])[:out]
    for view in (toks, rows, qsl, lens, nd, outs):
        assert view.storage_offset() % StepPacker.ALIGN == 0  # 16-byte aligned in the packed section


def mixed_runner(model, backend: str, graphs: bool, budget: int = 64, max_seqs: int = 8) -> ModelRunner:
    runner = ModelRunner(model, block_size=BS, num_blocks=64, attention_backend=backend,
                         max_num_seqs=max_seqs, max_model_len=64, max_num_batched_tokens=budget)
    assert runner.mixed_graphs is None  # CPU: always eager
    if graphs:
        runner.mixed_graphs = runner._mixed_graphs(use_cuda_graphs=False)
        runner.mixed_graphs.capture()
    return runner


def scenario():
    """Three steps over shuffled blocks: two fresh prompts (17 tokens); a decode, a resumed chunk and a
    prefix-cache hit over the first prompt's first 8 tokens (17); three decodes and a fresh 30-token prompt
    (33, the next size up)."""
    gen = torch.Generator().manual_seed(7)
    a, b, d = (torch.randint(3, 200, (n,), generator=gen).tolist() for n in (11, 13, 30))
    c = a[:8] + torch.randint(3, 200, (9,), generator=gen).tolist()
    ta, tb, tc = [3, 9, 1, 7, 30], [12, 5, 2, 11, 31], [3, 9, 6, 14, 8, 32]
    td = list(range(40, 48))
    a1, b1, c1 = a + [17], b + [18], c + [19]
    return [
        [Chunk(a, 0, ta[:3]), Chunk(b[:6], 0, tb[:2])],
        [Chunk([a[-1]], len(a), ta), Chunk(b[6:], 6, tb[:4]), Chunk(c[8:], 8, tc[:5])],
        [Chunk([a1[-1]], len(a), ta), Chunk([b1[-1]], len(b), tb), Chunk([c1[-1]], len(c), tc),
         Chunk(d, 0, td)],
    ]


def test_captured_mixed_steps_equal_eager_steps(tiny):
    graph_runner, eager_runner = mixed_runner(tiny, "torch", True), mixed_runner(tiny, "torch", False)
    assert graph_runner.mixed_graphs.sizes == [16, 32, 64]
    keys = []
    for chunks in scenario():
        torch.testing.assert_close(run_chunks(graph_runner, chunks), run_chunks(eager_runner, chunks),
                                   rtol=1e-5, atol=1e-5)
        keys.append(graph_runner.mixed_graphs.last_key)
    assert keys == [(32, 0), (32, 8), (64, 8)]
    torch.testing.assert_close(graph_runner.kv.data, eager_runner.kv.data, rtol=1e-6, atol=1e-6)
    assert not graph_runner.kv.data[:, :, 0].any()  # padding tokens wrote nothing, not even the null block


def test_a_step_takes_the_fewest_decode_rows_that_hold_its_decodes(tiny):
    """Below the cap min(size, max_seqs) the graphs hold MIXED_DECODE_ROWS decode rows: with 32 rows per
    step, 1-3 decodes replay the 16-row graphs; the three steps equal the eager runner's."""
    graph_runner = mixed_runner(tiny, "torch", True, max_seqs=32)
    eager_runner = mixed_runner(tiny, "torch", False, max_seqs=32)
    graphs = graph_runner.mixed_graphs
    assert [graphs.decode_row_counts(s) for s in graphs.sizes] == [[16], [16, 32], [16, 32]]
    assert graphs.keys == [(64, 32), (64, 16), (64, 0), (32, 32), (32, 16), (32, 0), (16, 16), (16, 0)]
    keys = []
    for chunks in scenario():
        torch.testing.assert_close(run_chunks(graph_runner, chunks), run_chunks(eager_runner, chunks),
                                   rtol=1e-5, atol=1e-5)
        keys.append(graphs.last_key)
    assert keys == [(32, 0), (32, 16), (64, 16)]
    assert graphs.takes(40, 17, 1) == (64, 32) and graphs.takes(20, 16, 1) == (32, 16)
    assert not graph_runner.kv.data[:, :, 0].any()


def test_decode_row_counts_follow_the_ladder_up_to_the_cap():
    from server.engine.batch_state import BatchState
    from server.engine.cuda_graphs import MIXED_DECODE_ROWS, MixedGraphs

    graphs = MixedGraphs(lambda *a: None, [16, 64, 128, 512], BatchState(256, 4, 4, torch.device("cpu")),
                         256, 8, torch.float32, torch.device("cpu"), use_cuda_graphs=False)
    assert MIXED_DECODE_ROWS == (16, 64)
    assert [graphs.decode_row_counts(s) for s in graphs.sizes] == [[16], [16, 64], [16, 64, 128],
                                                                    [16, 64, 256]]
    assert [graphs.takes(500, d, 1) for d in (0, 1, 16, 17, 64, 65, 256)] == \
        [(512, 0), (512, 16), (512, 16), (512, 64), (512, 64), (512, 256), (512, 256)]
    assert graphs.takes(500, 257, 1) is None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_captured_mixed_steps_on_the_triton_interpreter(tiny):
    """The real kernels: the decode kernel over 8 rows of which 0-3 decode, the prefill kernel over the whole
    padded batch with its chunks after the decode rows and empty padding chunks."""
    graph_runner, eager_runner = mixed_runner(tiny, "triton", True), mixed_runner(tiny, "torch", False)
    for chunks in scenario():
        torch.testing.assert_close(run_chunks(graph_runner, chunks), run_chunks(eager_runner, chunks),
                                   rtol=1e-4, atol=1e-4)
    assert graph_runner.mixed_graphs.num_replays == 3
    assert not graph_runner.kv.data[:, :, 0].any()


def test_a_step_above_the_largest_size_runs_eagerly(tiny):
    graph_runner, eager_runner = mixed_runner(tiny, "torch", True, 32), mixed_runner(tiny, "torch", False, 32)
    assert graph_runner.mixed_graphs.sizes == [16, 32]
    steps = scenario()
    for chunks in steps[:2]:
        run_chunks(graph_runner, chunks)
        run_chunks(eager_runner, chunks)
    assert graph_runner.mixed_graphs.num_replays == 2
    torch.testing.assert_close(run_chunks(graph_runner, steps[2]), run_chunks(eager_runner, steps[2]),
                               rtol=1e-5, atol=1e-5)  # 33 tokens > 32: eager
    assert graph_runner.mixed_graphs.num_replays == 2


def test_takes_refuses_more_chunks_or_decodes_than_the_size_holds(tiny):
    graphs = mixed_runner(tiny, "torch", True).mixed_graphs  # max_seqs 8
    assert graphs.takes(17, 1, 3) == (32, 8)
    assert graphs.takes(16, 0, 8) == (16, 0)  # chunks only: the graph without a decode launch
    assert graphs.takes(65, 0, 1) is None  # above the largest size
    assert graphs.takes(30, 0, 9) is None  # 9 chunks > min(32, 8)
    assert graphs.takes(30, 9, 1) is None  # 9 decode rows > min(32, 8)
