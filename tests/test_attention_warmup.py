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
    rows' new tokens (the fused forward's decode steps), and the plain call it is checked against, both on
    scratch caches: the step's cache is left as it was."""
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
    # each split count: on the step's cache (zero rows), then the check's pair on scratch caches
    assert plain == rotating and len(rotating) == 2 * n and n > 1
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


def _warm_up_with_new_tokens(kv, rows=12):
    from kernels.new_token_rope import NewTokens

    def scratch(batch):
        return NewTokens.scratch(batch, num_q_heads=4, num_kv_heads=2, head_dim=16, norm_width=24,
                                 bias=torch.randn(8 * 16), eps=1e-5, dtype=torch.float32, device="cpu")

    return warm_up_attention(kv, None, max_num_seqs=rows, max_blocks=512, num_q_heads=4,
                             decode_num_splits=None, new_tokens=scratch,
                             workspace=kernels.DecodeWorkspace(rows, 2, torch.device("cpu")))


def test_the_start_up_check_compares_the_one_launch_with_the_two(monkeypatch):
    """warm_up_attention runs the decode launch with new tokens on random rows over scratch caches against
    rope_store_kv + the plain launch: equal here (bitwise on the interpreter), so the device keeps it."""
    import server.engine.attention as attention

    monkeypatch.setattr(attention, "_ROPE_IN_DECODE_REFUSED", set())
    errors = []
    real = attention.rope_in_decode_error

    def spy(*args):
        errors.append(real(*args))
        return errors[-1]

    monkeypatch.setattr(attention, "rope_in_decode_error", spy)
    kv = KVCacheTensors(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    n = _warm_up_with_new_tokens(kv)
    assert len(errors) == n > 1 and errors == [0.0] * n
    assert not attention._ROPE_IN_DECODE_REFUSED


def test_a_one_launch_that_disagrees_at_start_up_is_not_used(monkeypatch, caplog):
    """Where the one launch is off (a compiler hazard the CPU cannot see), the check refuses it on that
    device with a warning and decode steps keep the RoPE + store kernel and the plain launch."""
    import logging

    import server.engine.attention as attention

    monkeypatch.setattr(attention, "_ROPE_IN_DECODE_REFUSED", set())
    real = kernels.paged_decode_attention

    def wrong_with_new_tokens(*args, new_tokens=None, **kw):
        out = real(*args, new_tokens=new_tokens, **kw)
        return out * 1.5 if new_tokens is not None else out

    monkeypatch.setattr(kernels, "paged_decode_attention", wrong_with_new_tokens)
    kv = KVCacheTensors(2, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="server.engine.attention"):
        _warm_up_with_new_tokens(kv)
    assert attention._ROPE_IN_DECODE_REFUSED == {torch.device("cpu")}
    assert "keep the two launches" in caplog.text
    meta = attention.AttentionMetadata(torch.zeros(4, dtype=torch.long), 4, torch.zeros(4, 4),
                                       torch.ones(4, dtype=torch.int32))
    assert not attention.ropes_in_decode_launch(meta, "triton")


def test_the_start_up_check_sees_a_wrong_store(monkeypatch):
    """The check compares the stored K/V too: a launch whose output is right but whose cache store is
    wrong (here: K stored un-rotated) is off."""
    import server.engine.attention as attention
    from kernels.new_token_rope import NewTokens

    kv = KVCacheTensors(1, 8, 4, 2, 16, torch.float32, torch.device("cpu"))
    real = kernels.paged_decode_attention

    def unrotated_k_store(q, k_cache, v_cache, *args, new_tokens=None, **kw):
        out = real(q, k_cache, v_cache, *args, new_tokens=new_tokens, **kw)
        if new_tokens is not None:  # the slot's K as projected (scaled, biased), not rotated
            slots = new_tokens.slot_mapping
            flat = k_cache.view(-1, *k_cache.shape[2:])
            flat[slots] = new_tokens.qkv.view(len(slots), -1, 16)[:, 4:6] * 0.5 + 3.0
        return out

    monkeypatch.setattr(kernels, "paged_decode_attention", unrotated_k_store)
    scratch = NewTokens.scratch(6, num_q_heads=4, num_kv_heads=2, head_dim=16, norm_width=None, bias=None,
                                eps=1e-5, dtype=torch.float32, device="cpu")
    k_cache, _ = kv.layer(0)
    assert attention.rope_in_decode_error(scratch, k_cache, 64, 4, 2, None, None) > 0.1


def test_a_nan_in_the_one_launch_fails_the_check(monkeypatch):
    """A NaN in the output or in a stored K/V is off by any measure (max() would drop a NaN after a
    number: a review)."""
    import server.engine.attention as attention
    from kernels.new_token_rope import NewTokens

    real = kernels.paged_decode_attention

    def nan_v_store(q, k_cache, v_cache, *args, new_tokens=None, **kw):
        out = real(q, k_cache, v_cache, *args, new_tokens=new_tokens, **kw)
        if new_tokens is not None:
            v_cache.view(-1, *v_cache.shape[2:])[new_tokens.slot_mapping] = float("nan")
        return out

    monkeypatch.setattr(kernels, "paged_decode_attention", nan_v_store)
    scratch = NewTokens.scratch(6, num_q_heads=4, num_kv_heads=2, head_dim=16, norm_width=None, bias=None,
                                eps=1e-5, dtype=torch.float32, device="cpu")
    k_cache, _ = KVCacheTensors(1, 8, 4, 2, 16, torch.float32, torch.device("cpu")).layer(0)
    assert not attention.rope_in_decode_error(scratch, k_cache, 64, 4, 2, None, None) <= 1.0
