"""Backend dispatch: auto/torch/triton resolution, errors naming the fix, last_backend reporting."""

import pytest
import torch
from kernel_cases import make_paged_case, reference_fp64, rel_error

import kernels


def test_resolve_auto_by_device():
    assert kernels.resolve_backend("cpu") == "torch"
    assert kernels.resolve_backend(torch.device("cpu"), "torch") == "torch"
    assert kernels.resolve_backend("cuda", "auto") == "triton"
    assert kernels.resolve_backend("cuda", "torch") == "torch"


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernels.resolve_backend("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.resolve_backend("cpu", "triton") == "triton"


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.resolve_backend("cpu", "cuda")


def test_torch_path_runs_reference_and_reports_it():
    case = make_paged_case([0, 12, 40], 8, 2, 24, 4, seed=2)   # head_dim 24: fine for torch
    out = kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                         case.seq_lens)
    assert kernels.last_backend() == "torch"
    assert rel_error(out, reference_fp64(case)) < 1e-6


@pytest.mark.parametrize("bs", [0, 3, 6, 100, 512, -4, 2.0, True, None])
def test_block_size_rule_in_one_place(bs):
    with pytest.raises(ValueError, match="power of two from 1 to 256"):
        kernels.check_block_size(bs)


def test_block_sizes_1_to_256_accepted():
    for bs in (1, 2, 16, 128, 256):
        kernels.check_block_size(bs)


def test_torch_path_rejects_int_dtype_and_non_pow2_block():
    case = make_paged_case([4], 2, 2, 16, 3)
    with pytest.raises(ValueError, match="power of two"):
        kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                       case.seq_lens)
    with pytest.raises(ValueError, match="float16"):
        kernels.store_kv(case.q.int(), case.q.int(), case.k_cache.int(), case.v_cache.int(),
                         torch.zeros(2, dtype=torch.int32))


def test_store_kv_torch_path():
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    kernels.store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1]))
    assert kernels.last_backend() == "torch"
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[1, 1], value[0])
    assert int((k_cache != 0).sum()) == 16


def test_the_engine_imports_without_triton():
    """A CPU-only install may lack triton (and importing it costs ~1 s): the engine and the server's modules
    import it only where a Triton path runs."""
    import subprocess
    import sys

    code = ("import sys; import server.engine.core, server.engine.runner, server.engine.batch_state, "
            "server.engine.engine, server.api.app; print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
