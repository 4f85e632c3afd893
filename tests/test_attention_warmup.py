"""warm_up_attention: one decode call per distinct split count an eager step can pick, then the prefill."""

import torch

import kernels
from server.engine.attention import warm_up_attention
from server.engine.kv_cache_tensors import KVCacheTensors


def test_one_decode_call_per_split_count_and_nothing_written(monkeypatch):
    kv = KVCacheTensors(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    kv.data.normal_()
    before = kv.data.clone()
    seen = []
    real = kernels.paged_decode_attention

    def spy(q, *args, num_splits=None, **kw):
        seen.append((q.shape[0], num_splits))
        out = real(q, *args, num_splits=num_splits, **kw)
        assert torch.equal(out, torch.zeros_like(out))          # seq_len 0 rows read nothing
        return out

    monkeypatch.setattr(kernels, "paged_decode_attention", spy)
    n = warm_up_attention(kv, None, max_num_seqs=40, max_blocks=512, num_q_heads=4, decode_num_splits=None,
                          workspace=None)
    want = {kernels.decode_num_splits(b, 2, 512 * 4, torch.device("cpu")) for b in range(1, 41)}
    assert n == len(seen) == len(want) > 1 and {s for _, s in seen} == want
    assert [b for b, _ in seen] == sorted(b for b, _ in seen)    # the smallest batch of each count
    assert torch.equal(kv.data, before)
    assert warm_up_attention(kv, None, 40, 512, 4, decode_num_splits=3, workspace=None) == 1


def test_new_token_variants_warm_up_and_write_nothing(monkeypatch):
    """With a new_tokens factory each split count also runs the decode call that rotates and stores its
    rows' new tokens (the fused forward's decode steps); the scratch rows' padding slots store nothing."""
    from kernels.new_token_rope import NewTokens

    kv = KVCacheTensors(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    kv.data.normal_()
    before = kv.data.clone()
    seen = []
    real = kernels.paged_decode_attention

    def spy(q, *args, num_splits=None, new_tokens=None, **kw):
        seen.append((q.shape[0], num_splits, new_tokens is not None))
        return real(q, *args, num_splits=num_splits, new_tokens=new_tokens, **kw)

    def scratch(rows):
        return NewTokens.scratch(rows, num_q_heads=4, num_kv_heads=2, head_dim=16, norm_width=24, bias=None,
                                 eps=1e-5, dtype=torch.float32, device="cpu")

    monkeypatch.setattr(kernels, "paged_decode_attention", spy)
    n = warm_up_attention(kv, None, max_num_seqs=40, max_blocks=512, num_q_heads=4, decode_num_splits=None,
                          workspace=None, new_tokens=scratch)
    plain = [(b, s) for b, s, new in seen if not new]
    rotating = [(b, s) for b, s, new in seen if new]
    assert len(plain) == n > 1 and rotating == plain
    assert torch.equal(kv.data, before)


def test_the_rope_goes_into_the_decode_launch_of_small_decode_only_steps():
    from server.engine.attention import (
        ROPE_IN_DECODE_MAX_ROWS,
        AttentionMetadata,
        PrefillMetadata,
        ropes_in_decode_launch,
    )

    def meta(rows, prefill=None):
        return AttentionMetadata(torch.zeros(rows, dtype=torch.long), rows, torch.zeros(rows, 4),
                                 torch.ones(rows, dtype=torch.int32), prefill)

    assert ropes_in_decode_launch(meta(2), "triton")
    assert ropes_in_decode_launch(meta(ROPE_IN_DECODE_MAX_ROWS), "triton")
    assert not ropes_in_decode_launch(meta(ROPE_IN_DECODE_MAX_ROWS + 1), "triton")
    assert not ropes_in_decode_launch(meta(8), "torch")
    chunks = PrefillMetadata(torch.zeros(1, 4), torch.tensor([8, 9]), torch.tensor([1]))
    assert not ropes_in_decode_launch(meta(8, chunks), "triton")
