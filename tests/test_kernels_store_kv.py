"""Triton store_kv vs the torch reference (interpreter on CPU): dtypes, block sizes, strides, padding."""

import os

import pytest
import torch

import kernels
from kernels import reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton kernel runs on CPU only under TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype,block_size,hkv,d,slot_dtype,strided", [
    (torch.float32, 1, 1, 32, torch.int64, False),
    (torch.float16, 16, 2, 80, torch.int32, True),
    (torch.float32, 256, 3, 64, torch.int32, True),
    (torch.float16, 4, 8, 128, torch.int64, False),
])
def test_store_kv_matches_reference(dtype, block_size, hkv, d, slot_dtype, strided):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, tokens = 8, 7
    shape = (num_blocks, block_size, 2 * hkv if strided else hkv, d)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(4)]
    if strided:
        caches = [c[:, :, ::2] for c in caches]
    k_tri, v_tri, k_ref, v_ref = caches[0], caches[1], caches[0].clone(), caches[1].clone()
    src = torch.randn(tokens, hkv, 2 * d, generator=gen).to(dtype)
    key, value = src[:, :, :d], src[:, :, d:]                       # non-contiguous rows
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(slot_dtype)
    slots[2] = -1
    kernels.store_kv(key, value, k_tri, v_tri, slots, backend="triton")
    assert kernels.last_backend() == "triton"
    reference.store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)


def test_store_kv_shape_errors():
    k_cache = torch.zeros(2, 4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.store_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), k_cache, k_cache.clone(),
                         torch.zeros(2, dtype=torch.int64), backend="triton")
    with pytest.raises(ValueError, match="key/value"):
        kernels.store_kv(torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), k_cache, k_cache.clone(),
                         torch.zeros(3, dtype=torch.int64), backend="triton")
