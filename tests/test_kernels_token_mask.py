"""kernels/token_mask.py against a dense boolean mask (the Triton interpreter on CPU, CUDA where present):
vocabularies that end mid-word and mid-block, negative words (bit 31 set), rows left out, poisoned output."""

from __future__ import annotations

import pytest
import torch

from kernels.token_mask import BLOCK, mask_tokens_
from server.engine.sampler import mask_tokens

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def dense_mask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """(G, W) int32 -> (G, vocab) bool: token t allowed where bit t % 32 of word t // 32 is set."""
    words = bits.to(torch.int64) & 0xFFFF_FFFF
    t = torch.arange(vocab)
    return ((words[:, t // 32] >> (t % 32)) & 1).bool()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab,rows", [(40, 3), (259, 5), (BLOCK + 77, 4), (3 * BLOCK, 2)])
def test_kernel_equals_a_dense_mask(device, vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[0, 0] = -1  # all allowed
    bits[-1, -1] = 0  # all masked
    logits = torch.randn(rows + 3, vocab, generator=gen)  # rows + 3: some rows are not guided
    samples = torch.randperm(rows + 3, generator=gen)[:rows]
    want = logits.clone()
    keep = dense_mask(bits, vocab)
    for g, s in enumerate(samples.tolist()):
        want[s] = want[s].masked_fill(~keep[g], float("-inf"))
    got = logits.to(device)
    mask_tokens_(got, samples.to(device), bits.to(device))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(mask_tokens(logits, samples, bits), want)  # the sampler's torch path


@pytest.mark.parametrize("device", DEVICES)
def test_no_guided_rows_leave_the_logits(device):
    logits = torch.randn(2, 64, device=device)
    before = logits.clone()
    mask_tokens_(logits, torch.empty(0, dtype=torch.int64, device=device),
                 torch.empty(0, 2, dtype=torch.int32, device=device))
    assert torch.equal(logits, before)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="fp32"):
        mask_tokens_(torch.zeros(1, 64, dtype=torch.float16), torch.tensor([0]),
                     torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="cover 32 tokens"):
        mask_tokens_(torch.zeros(1, 64), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32))
