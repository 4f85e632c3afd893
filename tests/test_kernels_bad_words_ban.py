"""kernels/bad_words_ban.py against the torch ban (BadWords.ban_ without the kernel) over random tables: rows
in any order and subset, words of every length up to the table's (PAD-padded, empty slots), recent tokens
that match a word's prefix where drawn so, two words of one row ending in one token, fp32 / fp16 logits
(bf16: on the GPU, the interpreter computes bf16 on bit patterns). Random logits, compared whole."""

from __future__ import annotations

import pytest
import torch

from kernels import bad_words_ban
from kernels.bad_words_ban import MAX_WORD_TOKENS, ban_
from server.engine.bad_words import HOLD_BACK, NONE, PAD, BadWords
from server.engine.sampler import BAD_WORDS, Sampler

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def random_tables(gen: torch.Generator, rows: int, words: int, length: int, vocab: int):
    """(words (R, B, L) int32, recent (R, L - 1) int64): about half the words match their row's recent."""
    table = torch.full((rows, words, length), PAD, dtype=torch.int32)
    recent = torch.randint(0, vocab, (rows, length - 1), generator=gen)
    recent[:, : (length - 1) // 3] = NONE  # rows that have sampled fewer than L - 1 tokens
    for r in range(rows):
        for b in range(words):
            n = int(torch.randint(0, length + 1, (1,), generator=gen))  # 0: an empty slot
            if n == 0:
                continue
            word = torch.randint(0, vocab, (n,), generator=gen)
            if n > 1 and torch.rand((), generator=gen) < 0.5:
                word[:-1] = recent[r, length - n:]  # its others are the row's last n - 1 tokens
            if b and table[r, b - 1, -1] >= 0 and torch.rand((), generator=gen) < 0.2:
                word[-1] = table[r, b - 1, -1]  # two words ending in one token
            table[r, b, length - n:] = word.int()
    return table, recent


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("words,length", [(1, 1), (3, 2), (17, 5), (40, MAX_WORD_TOKENS)])
def test_the_kernel_bans_as_the_torch_path(device, dtype, words, length):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 on the GPU: the interpreter computes bf16 on bit patterns")
    gen = torch.Generator().manual_seed(words * 100 + length)
    vocab, num_rows = 50, 6
    table, recent = random_tables(gen, num_rows, words, length, vocab)
    rows = torch.tensor([4, 0, 5, 2])
    logits = (torch.randn(len(rows), vocab, generator=gen) * 4).to(dtype)
    floor = max(HOLD_BACK, torch.finfo(dtype).min)
    torch_path = BadWords(num_rows, torch.device("cpu"))
    torch_path.words, torch_path.recent = table, recent
    want = torch_path.ban_(logits.float(), rows).clamp(min=floor)  # (the torch path bans fp32 rows)
    got = ban_(logits.to(device), rows.to(device), table.to(device), recent.to(device), floor)
    assert torch.equal(got.cpu(), want.to(dtype))  # (bf16 rounds the floor as the kernel's store does)
    assert (want == floor).any()  # the draw banned some


def test_a_table_past_the_kernels_width_is_refused():
    words = torch.zeros(1, 1, MAX_WORD_TOKENS + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        ban_(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64), words,
             torch.zeros(1, MAX_WORD_TOKENS, dtype=torch.int64), HOLD_BACK)


def test_a_kernel_sampler_bans_through_the_kernel():
    """The sampler's bad words take the kernel where its draws do (CUDA; here the interpreter): a banned
    greedy best token is never drawn."""
    from tests.test_engine_bad_words import init_row

    for kernel in (False, True):
        sampler = Sampler(max_rows=4, vocab_size=40, device=torch.device("cpu"), kernel=kernel)
        assert (sampler.bad_words._kernel is bad_words_ban) == kernel
        init_row(sampler, 0, [[5, 6], [9]])
        logits = torch.zeros(1, 40)
        logits[0, 9], logits[0, 1] = 3.0, 1.0
        assert sampler(logits, torch.tensor([0]), BAD_WORDS).token_ids.tolist() == [1]
