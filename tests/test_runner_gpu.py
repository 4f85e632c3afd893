"""The runner on CUDA: Triton kernels, profiled KV cache sizing, paged = dense, CUDA-graph decode = eager
(skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from runner_chunks import Chunk, run_chunks
from test_runner_cuda_graphs import graph_and_eager_steps, ragged

from server.engine.runner import ModelRunner
from server.model import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PROMPTS = ["The quick brown fox", "paged", "héllo 東京 🙂 " * 5]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over the finite logits; the presets mask non-printable ids with -inf, and both
    sides must mask the same ids."""
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite)
    a, b = a[finite].float(), b[finite].float()
    return float((a - b).abs().max() / b.abs().max())


def valid(logits: torch.Tensor) -> bool:
    """No NaN, nothing +inf, and every row has finite logits (only masked ids are -inf)."""
    return bool(not logits.isnan().any() and not logits.isposinf().any() and logits.isfinite().any(-1).all())


def dense_reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step last-token logits by recomputing the contiguous sequence."""
    seq, logits = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):
            pos = torch.arange(len(seq), device=model.device)
            hidden = model(torch.tensor(seq, device=model.device), pos)
            logits.append(model.compute_logits(hidden[-1:])[0])
            seq.append(int(logits[-1].argmax()))
    return seq[len(prompt) :], logits


def paged_logits(runner: ModelRunner, seqs: list[list[int]], prompt_lens: list[int]) -> list[list]:
    """Teacher-forced: prefill each prompt, then feed the given continuation one token per step."""
    bs = runner.block_size
    per_seq = -(-max(map(len, seqs)) // bs)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))[::-1] for i in range(len(seqs))]

    def chunk(i, start, end):
        return Chunk(seqs[i][start:end], start, tables[i])

    out = [[row] for row in run_chunks(runner, [chunk(i, 0, n) for i, n in enumerate(prompt_lens)])]
    for pos in range(min(prompt_lens), max(map(len, seqs)) - 1):
        live = [i for i, n in enumerate(prompt_lens) if n <= pos < len(seqs[i]) - 1]
        if not live:  # every sequence still in its prompt at this position: no step
            continue
        for i, row in zip(live, run_chunks(runner, [chunk(i, pos, pos + 1) for i in live]), strict=True):
            out[i].append(row)
    return out


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_triton_paged_logits_equal_dense(block_size):
    model, tok = load_model("tiny", "cuda", torch.float32)
    runner = ModelRunner(model, block_size=block_size, num_blocks=512, attention_backend="auto")
    assert runner.attention_backend == "triton"
    prompts = [tok.encode(p) for p in PROMPTS]
    refs = [dense_reference(model, p, 12) for p in prompts]
    seqs = [p + toks for p, (toks, _) in zip(prompts, refs, strict=True)]
    got = paged_logits(runner, seqs, [len(p) for p in prompts])
    for (_, ref_logits), rows in zip(refs, got, strict=True):
        assert len(rows) == len(ref_logits)
        for ref, row in zip(ref_logits, rows, strict=True):
            assert rel_err(row, ref) < 5e-3  # Triton may use TF32 dots in fp32


def test_kv_cache_is_sized_from_gpu_memory_utilization():
    model, _ = load_model("tiny", "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # earlier tests' cached blocks would make free_before smaller than the runner's
    free_before, total = torch.cuda.mem_get_info()
    used = total - free_before  # what earlier tests of this process hold counts against the share too
    fraction = used / total + 0.05
    runner = ModelRunner(model, block_size=16, gpu_memory_utilization=fraction)
    cache_bytes = runner.kv.data.numel() * runner.kv.data.element_size()
    allowed = fraction * total - used  # vLLM: the process's share, less what is in use already
    assert 0.5 * allowed < cache_bytes <= allowed  # tiny's activations and graph pool are far below half
    assert runner.capacity_tokens == (runner.num_blocks - 1) * 16
    logits = run_chunks(runner, [Chunk([1, 40, 41, 42], 0, [1])])
    assert logits.shape == (1, model.config.vocab_size) and valid(logits)


# ---- CUDA-graph decode ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bf16():
    model, _ = load_model("tiny", "cuda", torch.bfloat16)
    return model


def graph_runner(model, sizes=(1, 2, 4, 8), **kwargs) -> ModelRunner:
    runner = ModelRunner(model, block_size=16, num_blocks=256, max_num_seqs=8, **kwargs)
    assert runner.cuda_graphs and sorted(runner.graphs.graphs) == list(sizes)
    assert runner.state.block_tables.shape == (9, 2048 // 16)  # tiny's max_position_embeddings, + pad row
    return runner


@pytest.mark.parametrize("num_seqs", [1, 3, 4, 5, 8])
def test_graph_decode_equals_eager(tiny_bf16, num_seqs):
    """Exact (1, 4, 8) and padded (3 -> 4, 5 -> 8) buckets; ragged prompts of 1..13 tokens decoded for 20
    steps across the 16-token block boundary. The graph runs the split heuristic on the full-width table,
    eager on the batch's own width, so the bf16 rounding differs; a wrong row or padding leak would not."""
    runner = graph_runner(tiny_bf16)
    steps = graph_and_eager_steps(runner, ragged(num_seqs), steps=20, seed=num_seqs)
    assert runner.graphs.num_replays == 20
    for graph, eager in steps:
        assert graph.shape == (num_seqs, tiny_bf16.config.vocab_size) and valid(graph)
        assert rel_err(graph, eager) < 5e-2
    assert not runner.kv.data[:, :, 0].any()  # padding rows wrote nothing into the null block


@pytest.mark.parametrize("num_seqs", [1, 2, 4, 8])
def test_graph_decode_is_bitwise_eager_at_exact_buckets_with_fixed_splits(tiny_bf16, num_seqs):
    """Same shapes and a fixed split count on both paths: the graph replays exactly the eager kernels."""
    runner = graph_runner(tiny_bf16, decode_num_splits=4)
    for graph, eager in graph_and_eager_steps(runner, ragged(num_seqs), steps=20, seed=num_seqs):
        assert torch.equal(graph, eager)


def test_batch_above_the_largest_graph_runs_eagerly(tiny_bf16):
    runner = graph_runner(tiny_bf16, sizes=(1, 2, 4), max_num_batched_tokens=4)
    for graph, eager in graph_and_eager_steps(runner, ragged(5), steps=3):
        assert torch.equal(graph, eager) and valid(graph)
    assert runner.graphs.num_replays == 0


def test_enforce_eager_captures_nothing(tiny_bf16):
    runner = ModelRunner(tiny_bf16, block_size=16, num_blocks=64, enforce_eager=True)
    assert not runner.cuda_graphs and runner.graphs is None


def test_captured_mixed_steps_equal_eager_steps(tiny_bf16):
    """Real mixed graphs (sizes 16/32/64): fresh prompts, a decode with a resumed chunk and a prefix-cache
    hit, decodes with a fresh prompt, against an eager runner fed the same steps (bf16: the decode split
    counts differ between the padded and the exact batch)."""
    from test_runner_mixed_graphs import scenario
    kwargs = dict(block_size=4, num_blocks=64, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64)
    runner = ModelRunner(tiny_bf16, **kwargs)
    eager = ModelRunner(tiny_bf16, enforce_eager=True, **kwargs)
    assert runner.cuda_graphs and sorted(runner.mixed_graphs.graphs) == [(16, 0), (16, 8), (32, 0), (32, 8),
                                                                        (64, 0), (64, 8)]
    for chunks in scenario():
        graph_logits, eager_logits = run_chunks(runner, chunks), run_chunks(eager, chunks)
        assert valid(graph_logits) and rel_err(graph_logits, eager_logits) < 5e-2
    assert runner.mixed_graphs.num_replays == 3 and eager.mixed_graphs is None
    assert not runner.kv.data[:, :, 0].any()  # padding tokens wrote nothing into the null block


def test_a_burst_of_requests_takes_no_new_device_memory():
    """The eager tail of a step (logits of every sampling row, fp32 and model dtype) has its blocks in the
    caching allocator from start-up: a burst whose logit rows grow step by step (each mixed step samples the
    rows decoding plus its new prompts) calls cudaMalloc for none of them (it did at every step)."""
    from server.engine.engine import EngineConfig, build_core
    from server.engine.outputs import EngineRequest
    from server.engine.sampling_params import SamplingParams

    core, _ = build_core(EngineConfig(model="bench", device="cuda", dtype="bfloat16", max_num_seqs=256,
                                      max_num_batched_tokens=4096, num_blocks=8192))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(256):  # 256 prompts of 128 tokens: 32 a step, each step samples 32 more rows
        core.add_request(EngineRequest(f"r{i}", [3 + (i * 131 + j) % 1000 for j in range(128)], params, 0.0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["num_device_alloc"]
    while core.has_work():
        core.step()
    assert torch.cuda.memory_stats()["num_device_alloc"] == before
