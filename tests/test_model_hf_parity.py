"""Our loader + runner against transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import hf_config, write_hf_checkpoint
from runner_chunks import Chunk, run_chunks

from server.engine.runner import ModelRunner
from server.model import load_model

pytest.importorskip("transformers")

ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
CASES = {
    "llama-llama3-rope-untied": ("llama", dict(rope_parameters=ROPE_LLAMA3, tie_word_embeddings=False)),
    "qwen2-tied-qkv-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=7, head_dim=16)),
}
PROMPTS = ["The quick brown fox", "héllo 東京 🙂 and a longer prompt about paged attention", "def"]
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf_model = write_hf_checkpoint(path, hf_config(arch, **overrides))
    model, tokenizer = load_model(str(path), "cpu", torch.float32)
    return hf_model, model, tokenizer


class Allocator:
    """Consecutive fresh blocks per sequence (block 0 is the null block)."""

    def __init__(self) -> None:
        self.next = 1

    def table(self, num_tokens: int) -> list[int]:
        nb = -(-num_tokens // BLOCK_SIZE)
        self.next += nb
        return list(range(self.next - nb, self.next))


def slots(table: list[int], start: int, end: int) -> list[int]:
    return [table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(start, end)]


def greedy_paged(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[torch.Tensor, list]:
    """Prefill all prompts in one step, then decode all of them together; -> (prefill logits, new tokens)."""
    alloc = Allocator()
    tables = [alloc.table(len(p) + steps) for p in prompts]
    chunks = [Chunk(p, 0, t, slots(t, 0, len(p))) for p, t in zip(prompts, tables, strict=True)]
    logits = prefill_logits = run_chunks(runner, chunks)
    seqs = [list(p) for p in prompts]
    for step in range(steps):
        for s, row in zip(seqs, logits, strict=True):
            s.append(int(row.argmax()))
        if step + 1 < steps:
            chunks = [Chunk(s[-1:], len(s) - 1, t, slots(t, len(s) - 1, len(s)))
                      for s, t in zip(seqs, tables, strict=True)]  # fmt: skip
            logits = run_chunks(runner, chunks)
    return prefill_logits, [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def test_last_token_logits_match_transformers(checkpoint):
    hf_model, model, tokenizer = checkpoint
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    runner = ModelRunner(model, block_size=BLOCK_SIZE, num_blocks=64, attention_backend="torch")
    ours, _ = greedy_paged(runner, prompts, steps=1)
    for prompt, row in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0, -1]
        rel = (row - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"relative logits error {rel:.2e} for prompt of {len(prompt)} tokens"


def test_greedy_continuations_match_transformers_generate(checkpoint):
    hf_model, model, tokenizer = checkpoint
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts must be ragged"
    runner = ModelRunner(model, block_size=BLOCK_SIZE, num_blocks=64, attention_backend="torch")
    steps = 16
    _, ours = greedy_paged(runner, prompts, steps)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                    max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert got == out[0, len(prompt) :].tolist()


def test_tokenizer_and_eos_from_checkpoint(checkpoint):
    _, model, tokenizer = checkpoint
    assert tokenizer.bos_token_id == 1 and 2 in tokenizer.eos_token_ids
    ids = tokenizer.encode(PROMPTS[1])
    assert ids[0] == 1 and tokenizer.decode(ids) == PROMPTS[1]
    assert model.config.vocab_size >= tokenizer.vocab_size
