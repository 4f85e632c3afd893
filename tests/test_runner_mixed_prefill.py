"""A mixed step through the Triton kernels (interpreter) equals the torch backend and a dense recompute: one
decode row, a chunked prefill resuming over its own cached prefix, and a prefix-cache hit, in one step."""

import os

import pytest
import torch
from runner_chunks import Chunk, run_chunks

from server.engine.runner import ModelRunner
from server.model import load_model

BS = 4


def _chunk(table, ids, start):
    return Chunk(list(ids), start, list(table))


def _steps(runner, a, b, c):
    """Step 1: a whole, b's first 6 tokens. Step 2: a decodes, b's other 7, c over a's first 8 (2 blocks)."""
    ta, tb = [3, 9, 1, 7], [12, 5, 2, 11]                                  # physical blocks, shuffled
    tc = ta[:2] + [6, 14, 8]                                               # c's first 8 tokens are a's
    run_chunks(runner, [_chunk(ta, a, 0), _chunk(tb, b[:6], 0)])
    step2 = [_chunk(ta, [a[-1]], len(a)), _chunk(tb, b[6:], 6), _chunk(tc, c[8:], 8)]
    return run_chunks(runner, step2)                                           # (3, V)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_mixed_step_triton_matches_torch_and_dense():
    model, _ = load_model("tiny", "cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(3, 200, (11,), generator=gen).tolist()
    b = torch.randint(3, 200, (13,), generator=gen).tolist()
    c = a[:8] + torch.randint(3, 200, (9,), generator=gen).tolist()
    import kernels.paged_prefill as paged_prefill
    takes = []  # whether each prefill launch read the new keys from the step's K/V rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paged_prefill, "takes_new_kv",
                   lambda k, v, real=paged_prefill.takes_new_kv: takes.append(real(k, v)) or takes[-1])
        logits = {be: _steps(ModelRunner(model, block_size=BS, num_blocks=16, attention_backend=be), a, b, c)
                  for be in ("torch", "triton")}
    assert takes and all(takes), takes   # the runner passes its qkv views, which the kernel reads
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        dense = [model.compute_logits(model(torch.tensor(s), torch.arange(len(s)))[-1:])
                 for s in (a + [a[-1]], b, c)]
    torch.testing.assert_close(logits["triton"], torch.cat(dense), rtol=1e-4, atol=1e-4)


def test_eager_logits_run_over_a_padded_row_count_and_return_the_real_rows():
    """The eager head runs over a decode-graph batch size of rows (the counts start-up warms on CUDA, so
    no served step meets cuBLAS's first call at a new count); the step's logits are its own rows only, the
    same as without the padding."""
    model, _ = load_model("tiny", "cpu", torch.float32)
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(3, 200, (n,), generator=gen).tolist() for n in (11, 13))
    c = a[:8] + torch.randint(3, 200, (9,), generator=gen).tolist()  # its first 8 tokens are a's cached ones
    counts = []
    real = model.compute_logits
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "compute_logits", lambda h: counts.append(h.shape[0]) or real(h))
        logits = _steps(ModelRunner(model, block_size=BS, num_blocks=16, attention_backend="torch"), a, b, c)
    assert counts == [2, 4], counts  # the steps' 2 and 3 logit rows
    assert logits.shape[0] == 3
    with torch.inference_mode():
        dense = [real(model(torch.tensor(s), torch.arange(len(s)))[-1:]) for s in (a + [a[-1]], b, c)]
    torch.testing.assert_close(logits, torch.cat(dense), rtol=1e-4, atol=1e-4)
