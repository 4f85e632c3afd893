"""Paged = contiguous: the runner's greedy tokens equal a dense recompute of the whole sequence, whatever the
block size, the physical block order, prefix-cache hits, chunked prefill, mixed batches or forks."""

from __future__ import annotations

import random
from functools import cache

import pytest
import torch
from runner_chunks import Chunk, run_chunks

import kernels
from kvcache import KVCacheManager
from server.engine.runner import ModelRunner
from server.model import load_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "paged attention",
    "héllo 東京 🙂, a prompt whose length is not a multiple of anything in particular.",
]


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny", "cpu", torch.float32)
    return model, tokenizer


@cache
def _dense_greedy(model, ids: tuple[int, ...], steps: int) -> tuple[int, ...]:
    """Greedy continuation by recomputing the whole contiguous sequence each step (no KV cache at all)."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            hidden = model(torch.tensor(seq), torch.arange(len(seq)))
            seq.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tuple(seq[len(ids) :])


def dense_greedy(model, ids: list[int], steps: int) -> list[int]:
    return list(_dense_greedy(model, tuple(ids), steps))


class ShuffledBlocks:
    """A tiny allocator: free blocks 1..N-1 in a seeded random order; tables grow on demand."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}

    def grow(self, seq: str, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table

    def chunk(self, seq: str, token_ids: list[int], start: int) -> Chunk:
        return Chunk(list(token_ids), start, list(self.grow(seq, start + len(token_ids))))


def decode_together(runner, blocks, seqs: dict[str, list[int]], logits, steps: int) -> None:
    """Append argmax of `logits` (one row per seq, dict order) to each seq, then decode all of them."""
    for step in range(steps):
        for seq, row in zip(seqs.values(), logits, strict=True):
            seq.append(int(row.argmax()))
        if step + 1 < steps:
            logits = run_chunks(runner, [blocks.chunk(name, s[-1:], len(s) - 1) for name, s in seqs.items()])


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_block_size_and_shuffled_physical_blocks(tiny, block_size):
    model, tok = tiny
    prompts = [tok.encode(p) for p in PROMPTS]
    num_blocks = 1 + sum(-(-(len(p) + 12) // block_size) for p in prompts)
    runner = ModelRunner(model, block_size=block_size, num_blocks=num_blocks, attention_backend="torch")
    blocks = ShuffledBlocks(num_blocks, block_size, seed=block_size)
    seqs = {f"s{i}": list(p) for i, p in enumerate(prompts)}
    logits = run_chunks(runner, [blocks.chunk(n, s, 0) for n, s in seqs.items()])
    decode_together(runner, blocks, seqs, logits, steps=12)
    for prompt, seq in zip(prompts, seqs.values(), strict=True):
        assert seq[len(prompt) :] == dense_greedy(model, prompt, 12)


def test_prefix_cache_hit_shares_blocks_and_starts_late(tiny):
    model, tok = tiny
    bs = 8
    runner = ModelRunner(model, block_size=bs, num_blocks=64, attention_backend="torch")
    blocks = ShuffledBlocks(64, bs, seed=1)
    a = tok.encode("A shared system prompt, then question one?")
    b = a[:32] + tok.encode("Different tail: question two!", add_bos=False)
    run_chunks(runner, [blocks.chunk("a", a, 0)])
    blocks.tables["b"] = list(blocks.tables["a"][:4])  # 32 cached tokens = 4 full blocks of `a`
    shared_before = runner.kv.data[:, :, blocks.tables["a"][:4]].clone()
    logits = run_chunks(runner, [blocks.chunk("b", b[32:], 32)])
    seqs = {"b": list(b)}
    decode_together(runner, blocks, seqs, logits, steps=10)
    assert seqs["b"][len(b) :] == dense_greedy(model, b, 10)
    assert torch.equal(runner.kv.data[:, :, blocks.tables["a"][:4]], shared_before)


def test_chunked_prefill_in_mixed_batches(tiny):
    model, tok = tiny
    bs = 4
    runner = ModelRunner(model, block_size=bs, num_blocks=128, attention_backend="torch")
    blocks = ShuffledBlocks(128, bs, seed=2)
    a, b = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[2])
    seq_a = list(a)
    logits = run_chunks(runner, [blocks.chunk("a", a, 0)])
    seq_a.append(int(logits[0].argmax()))
    for start in range(0, len(b), 5):  # b arrives 5 tokens per step, each step also decodes a
        end = min(start + 5, len(b))
        chunks = [blocks.chunk("a", seq_a[-1:], len(seq_a) - 1), blocks.chunk("b", b[start:end], start)]
        logits = run_chunks(runner, chunks)
        seq_a.append(int(logits[0].argmax()))
    seqs = {"a": seq_a[:-1], "b": list(b)}
    decode_together(runner, blocks, seqs, logits, steps=6)
    assert seqs["a"][len(a) :] == dense_greedy(model, a, len(seqs["a"]) - len(a))
    assert seqs["b"][len(b) :] == dense_greedy(model, b, 6)


def test_fork_then_copy_on_write_keeps_parent_and_child_apart(tiny):
    model, tok = tiny
    bs = 8
    runner = ModelRunner(model, block_size=bs, num_blocks=64, attention_backend="torch")
    blocks = ShuffledBlocks(64, bs, seed=3)
    parent = tok.encode("Fork me after a partial block")  # 30 tokens: last block partial
    assert len(parent) % bs != 0
    logits = run_chunks(runner, [blocks.chunk("p", parent, 0)])
    first = int(logits[0].argmax())
    forced = (first + 1) % model.config.vocab_size  # the child continues with a different token
    table = blocks.tables["p"]
    child_table = table[:-1] + [blocks.free.pop()]  # full blocks shared, partial last block copied
    runner.kv.copy_blocks(torch.tensor([(table[-1], child_table[-1])]))
    assert torch.equal(runner.kv.data[:, :, child_table[-1]], runner.kv.data[:, :, table[-1]])
    blocks.tables["c"] = child_table
    seqs = {"p": parent + [first], "c": parent + [forced]}
    logits = run_chunks(runner, [blocks.chunk(n, s[-1:], len(parent)) for n, s in seqs.items()])
    decode_together(runner, blocks, seqs, logits, steps=8)
    assert seqs["p"][len(parent) :] == dense_greedy(model, parent, 9)
    assert seqs["c"][len(parent) + 1 :] == dense_greedy(model, parent + [forced], 8)


def test_kvcache_manager_prefix_hit_and_fork(tiny):
    """The same scenario driven by the real kvcache.KVCacheManager block bookkeeping."""
    model, tok = tiny
    bs = 4
    mgr = KVCacheManager(96, bs, enable_prefix_caching=True)
    runner = ModelRunner(model, block_size=bs, num_blocks=96, attention_backend="torch")
    a = tok.encode("Common prefix for both requests; then A")
    b = a[:-1] + tok.encode("B", add_bos=False)
    seqs: dict[str, list[int]] = {}

    def chunk(seq_id, start):
        ids = seqs[seq_id]
        return Chunk(ids[start:], start, mgr.block_table(seq_id))

    def step(seq_ids, starts):
        logits = run_chunks(runner, [chunk(s, st) for s, st in zip(seq_ids, starts, strict=True)])
        for s, row in zip(seq_ids, logits, strict=True):
            mgr.mark_computed(s, len(seqs[s]), seqs[s])
            seqs[s].append(int(row.argmax()))
            assert mgr.append_slots(s, 1)

    seqs["a"] = list(a)
    assert mgr.allocate("a", a) is not None
    step(["a"], [0])
    seqs["b"] = list(b)
    assert mgr.allocate("b", b) is not None
    hit = mgr.num_cached_tokens("b")
    assert hit > 0 and hit % bs == 0
    step(["b"], [hit])
    seqs["c"] = list(seqs["a"])
    copies = mgr.fork("a", "c")
    runner.kv.copy_blocks(torch.tensor(copies).view(-1, 2))
    for _ in range(6):
        step(["a", "b", "c"], [len(seqs[s]) - 1 for s in ("a", "b", "c")])
    mgr.check_integrity()
    assert seqs["a"][len(a) :] == dense_greedy(model, a, 7)
    assert seqs["b"][len(b) :] == dense_greedy(model, b, 7)
    assert seqs["c"] == seqs["a"]


def test_triton_interpreter_backend_matches_torch(tiny):
    try:
        kernels.resolve_backend("cpu", "triton")
    except ValueError as exc:
        pytest.skip(str(exc))
    model, tok = tiny
    results = []
    # splits=3: the runner's DecodeWorkspace merges the KV splits inside the decode launch
    for backend, splits in (("torch", None), ("triton", None), ("triton", 3)):
        runner = ModelRunner(model, block_size=8, num_blocks=32, attention_backend=backend,
                             decode_num_splits=splits)
        assert runner.attention_backend == backend
        assert (runner.decode_workspace is None) == (backend == "torch")
        blocks = ShuffledBlocks(32, 8, seed=4)
        seqs = {"a": tok.encode(PROMPTS[0]), "b": tok.encode(PROMPTS[1])}
        logits = run_chunks(runner, [blocks.chunk(n, s, 0) for n, s in seqs.items()])
        decode_together(runner, blocks, seqs, logits, steps=3)
        results.append((seqs, run_chunks(runner, [blocks.chunk(n, s[-1:], len(s) - 1)
                                                  for n, s in seqs.items()])))
        assert runner.decode_workspace is None or runner.decode_workspace.idle()
    for seqs, logits in results[1:]:
        assert seqs == results[0][0]
        torch.testing.assert_close(logits, results[0][1], rtol=1e-4, atol=1e-4)


def test_cpu_cache_defaults(tiny):
    model, _ = tiny
    runner = ModelRunner(model, block_size=16)
    assert runner.attention_backend == kernels.resolve_backend("cpu", "auto")
    assert runner.num_blocks == 8192 // 16 and runner.capacity_tokens == (8192 // 16 - 1) * 16
    assert runner.device == torch.device("cpu") and runner.dtype == torch.float32


def test_profiling_dummy_batch_is_a_valid_maximal_step(tiny):
    """The step that sizes the CUDA KV cache (run here on CPU): max tokens over max seqs, own blocks, each
    sampling with top-p."""
    model, _ = tiny
    runner = ModelRunner(model, block_size=16, num_blocks=2, max_num_batched_tokens=300, max_num_seqs=7)
    step, tables, blocks_needed = runner._dummy_step()
    assert step.num_prefill_tokens == 300 and len(step.prefills) == 7 and len(step.samples) == 7
    blocks = [b for t in tables.values() for b in t]
    assert len(set(blocks)) == len(blocks) and min(blocks) == 1 and max(blocks) == blocks_needed - 1
    runner.kv, runner.num_blocks = runner._allocate_cache(blocks_needed), blocks_needed
    tokens = runner.execute(step, tables.__getitem__).wait().token_ids
    assert len(tokens) == 7 and all(0 <= t < model.config.vocab_size for t in tokens)


def test_a_head_dim_the_triton_kernels_cannot_take_is_served_by_torch_or_refused(monkeypatch):
    """head_dim 8 (open_llama_3b's is 100): asked for, the Triton backend is refused at start-up naming
    head_dim; "auto", which takes Triton on CUDA (resolve_backend, made to here), serves it with the torch
    backend. Before, the engine started and failed every request at its first KV store (a review)."""
    from server.model.config import preset
    from server.model.loader import build_model
    from server.model.random_init import init_random_weights

    config = preset("tiny", head_dim=8, num_layers=1)
    model = build_model(config, torch.device("cpu"), torch.float32)
    init_random_weights(model, config)
    with pytest.raises(ValueError, match="head_dim in multiples of 16 .* got 8"):
        ModelRunner(model, block_size=4, num_blocks=16, attention_backend="triton")
    monkeypatch.setattr(kernels, "resolve_backend", lambda device, requested: "triton")  # as on CUDA
    runner = ModelRunner(model, block_size=4, num_blocks=16, attention_backend="auto")
    assert runner.attention_backend == "torch" and runner.decode_workspace is None
    blocks = ShuffledBlocks(16, 4, seed=1)
    logits = run_chunks(runner, [blocks.chunk("a", [1, 40, 41, 42, 43], 0)])
    assert torch.isfinite(logits).all()
