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
