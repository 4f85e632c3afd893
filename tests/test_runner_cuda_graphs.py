"""CUDA-graph decode, the parts that run on CPU: bucket sizes, padding, and the static-buffer replay path
(DecodeGraphs with use_cuda_graphs=False: the static inputs, the in-graph gathers from the persistent batch
state and the padding rows, minus the capture) against the eager runner. tests/test_runner_gpu.py runs the
same comparison with real graphs."""

from __future__ import annotations

import pytest
import torch
from runner_chunks import Chunk, RaggedBatch, run_chunks

import kernels
from server.cli import build_parser, engine_config
from server.engine.batch_state import BatchState
from server.engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from server.engine.engine import EngineConfig, build_core
from server.engine.runner import ModelRunner
from server.model import load_model


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", "cpu", torch.float32)
    return model


# ---- pure functions -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_num_seqs, sizes",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (12, [1, 2, 4, 8, 12]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
        (100, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]),
    ],
)
def test_capture_sizes(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def test_capture_sizes_rejects_zero():
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        capture_sizes(0)


def test_padded_size_is_the_smallest_bucket_that_fits():
    sizes = capture_sizes(100)
    for n in range(1, 101):
        got = padded_size(n, sizes)
        assert got in sizes and got >= n and all(s < n for s in sizes if s < got)
    assert padded_size(1, sizes) == 1 and padded_size(3, sizes) == 4 and padded_size(17, sizes) == 32
    assert padded_size(101, sizes) is None


def test_decode_graphs_rejects_unsorted_sizes(tiny):
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphs(lambda *a: None, [4, 2], BatchState(4, 8, 4, torch.device("cpu")), 256, torch.float32,
                     torch.device("cpu"), False)


# ---- the static-buffer replay path vs eager ---------------------------------------------------------------


def run_eager(runner: ModelRunner, chunks: list[Chunk]) -> torch.Tensor:
    graphs, runner.graphs = runner.graphs, None
    try:
        return run_chunks(runner, chunks)
    finally:
        runner.graphs = graphs


def graph_and_eager_steps(runner: ModelRunner, lengths: list[int], steps: int, seed: int = 0):
    """Per decode step: (logits through the graph path, eager logits of the same step). The eager run comes
    second and rewrites the same K/V slots, so both see the same history at every step."""
    batch = RaggedBatch(lengths, runner.block_size, runner.num_blocks, seed)
    run_chunks(runner, batch.prefill())
    out = []
    for _ in range(steps):
        chunks = batch.decode()
        out.append((run_chunks(runner, chunks), run_eager(runner, chunks)))
    return out


def ragged(num_seqs: int) -> list[int]:
    return [(3 + 5 * i) % 13 + 1 for i in range(num_seqs)]  # 4, 9, 1, 6, 11, 3, ...


def cpu_graph_runner(model, backend: str = "torch", max_num_batched_tokens: int = 64) -> ModelRunner:
    runner = ModelRunner(model, block_size=4, num_blocks=64, attention_backend=backend, max_num_seqs=8,
                         max_model_len=64, max_num_batched_tokens=max_num_batched_tokens)
    assert not runner.cuda_graphs and runner.graphs is None  # CPU: always eager
    runner.graphs = runner._decode_graphs(use_cuda_graphs=False)
    runner.graphs.capture()
    assert runner.state.block_tables.shape == (9, 16)  # 8 rows + the pad row, 64 tokens of blocks
    return runner


@pytest.mark.parametrize("num_seqs", [1, 3, 4, 5, 8])
def test_static_replay_equals_eager(tiny, num_seqs):
    """Exact (1, 4, 8) and padded (3 -> 4, 5 -> 8) buckets, ragged lengths, 6 steps across 4-token blocks."""
    runner = cpu_graph_runner(tiny)
    assert runner.graphs.sizes == [1, 2, 4, 8]
    steps = graph_and_eager_steps(runner, ragged(num_seqs), steps=6, seed=num_seqs)
    assert runner.graphs.num_replays == 6
    for graph, eager in steps:
        assert graph.shape == (num_seqs, tiny.config.vocab_size)
        torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
    assert not runner.kv.data[:, :, 0].any()  # padding rows wrote nothing, not even into the null block


def test_batch_above_the_largest_bucket_runs_eagerly(tiny):
    runner = cpu_graph_runner(tiny, max_num_batched_tokens=4)
    assert runner.graphs.sizes == [1, 2, 4]
    for graph, eager in graph_and_eager_steps(runner, ragged(5), steps=2):
        torch.testing.assert_close(graph, eager, rtol=0, atol=0)
    assert runner.graphs.num_replays == 0


def test_mixed_and_multi_token_batches_run_eagerly(tiny):
    runner = cpu_graph_runner(tiny)
    batch = RaggedBatch([5, 1], runner.block_size, runner.num_blocks)
    run_chunks(runner, batch.prefill())  # a 5-token prefill with a 1-token one: eager
    assert runner.graphs.num_replays == 0
    run_chunks(runner, batch.decode())
    assert runner.graphs.num_replays == 1


def test_padding_rows_are_rewritten_every_replay(tiny):
    """A smaller batch after a larger one in the same bucket: the rows beyond it must be padding again, not
    the previous step's rows (which would write stale K/V into live sequences' slots)."""
    runner = cpu_graph_runner(tiny)
    batch = RaggedBatch([5, 6, 7, 3], runner.block_size, runner.num_blocks)
    run_chunks(runner, batch.prefill())
    run_chunks(runner, batch.decode())  # 4 rows: bucket 4
    before = runner.kv.data.clone()
    chunks = batch.decode()[:3]  # 3 rows: bucket 4 again, row 3 is padding
    graph = run_chunks(runner, chunks)
    written = (runner.kv.data != before).any(dim=(0, 1, 4, 5)).nonzero().tolist()  # (block, offset) pairs
    assert len(written) == 3  # one slot per real row, none for the padding row
    torch.testing.assert_close(graph, run_eager(runner, chunks), rtol=1e-5, atol=1e-5)


def test_static_replay_on_the_triton_interpreter(tiny):
    """The real kernels over the full-width static table, padding rows with seq_len 0 and slot -1."""
    try:
        kernels.resolve_backend("cpu", "triton")
    except ValueError as exc:
        pytest.skip(str(exc))
    runner = cpu_graph_runner(tiny, backend="triton")
    for graph, eager in graph_and_eager_steps(runner, ragged(3), steps=2):
        torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)
    assert runner.graphs.num_replays == 2


def test_a_failed_capture_leaves_the_runner_eager(tiny, caplog):
    runner = ModelRunner(tiny, block_size=4, num_blocks=16, attention_backend="torch")
    runner.cuda_graphs = True
    runner._capture_graphs()  # real capture on a CPU runner: torch.cuda fails
    assert not runner.cuda_graphs and runner.graphs is None and runner.mixed_graphs is None
    assert "CUDA graph capture failed; running eagerly" in caplog.text
    assert run_chunks(runner, [Chunk([5], 0, [1])]).shape == (1, tiny.config.vocab_size)


def test_enforce_eager_flag_reaches_the_engine_config():
    parse = build_parser().parse_args
    assert engine_config(parse(["serve", "--enforce-eager"])).enforce_eager is True
    assert engine_config(parse(["serve"])).enforce_eager is False


def test_engine_sizes_the_graphs_from_its_limits():
    core, _ = build_core(EngineConfig(model="tiny", device="cpu", attention_backend="torch", num_blocks=16,
                                      max_num_seqs=5, max_num_batched_tokens=64, max_model_len=100))
    runner = core.runner
    assert (runner.max_num_seqs, runner.max_num_batched_tokens, runner.max_model_len) == (5, 64, 100)
    graphs = runner._decode_graphs(use_cuda_graphs=False)
    assert graphs.sizes == [1, 2, 4, 5] and runner.state.max_blocks == 7  # ceil(100 / 16)


def test_a_greedy_decode_step_takes_the_argmax_of_the_graph_output(tiny):
    """All-greedy decode steps take the argmax of the graph's model-dtype logits (no fp32 copy of them);
    execute then samples exactly the tokens an eager step's logits give."""
    from runner_chunks import step_of
    runner = cpu_graph_runner(tiny)
    batch = RaggedBatch(ragged(5), runner.block_size, runner.num_blocks, seed=3)
    run_chunks(runner, batch.prefill())
    for _ in range(3):
        chunks = batch.decode()
        step, tables, index = step_of(chunks)
        s = runner.forward_step(step, tables.__getitem__)
        assert s.flags == 0 and s.greedy is not None and torch.equal(s.greedy, s.logits.argmax(dim=-1))
        eager = run_eager(runner, chunks)  # rewrites the same slots; rows in chunk order
        step, tables, index = step_of(chunks)
        tokens = runner.execute(step, tables.__getitem__).wait().token_ids
        assert [tokens[i] for i in index] == eager.argmax(dim=-1).tolist()
