"""kernels.l2_hint: when it writes the evict-first L2 policy into the decode kernel's cp.async PTX, and that
the result assembles. The GPU side (the hinted kernel runs and is correct) is in tests/test_gpu_kernels.py."""

import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
from kernels import l2_hint  # noqa: E402
from kernels.sass_probe import BIN  # noqa: E402

PTX = """\
.visible .entry _paged_decode_stage1(
\t.param .u64 p0
)
{
\t.reg .pred \t%p<4>;
\t.reg .b32 \t%r<9>;
\t.reg .b64 \t%rd<5>;
\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;
\tcp.async.cg.shared.global [ %r3 + 2048 ], [ %rd2 + 0 ], 0x10;
\tcp.async.ca.shared.global [ %r4 + 0 ], [ %rd3 + 0 ], 0x4, %r5;
\tcp.async.commit_group;
\tret;
}
"""


def test_every_16_byte_cp_async_gets_the_one_policy():
    out = l2_hint.add_evict_first_hint(PTX)
    policy = l2_hint.POLICY_REG
    assert out.count(f".reg .b64 \t{policy};") == 1
    assert out.count(f"createpolicy.fractional.L2::evict_first.b64 \t{policy}, 1.0;") == 1
    # declared after the last .reg line, created before the first instruction
    assert out.index("%rd<5>") < out.index(policy) < out.index("cp.async")
    assert f"cp.async.cg.shared.global.L2::cache_hint [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2, {policy};" in out
    assert f"cp.async.cg.shared.global.L2::cache_hint [ %r3 + 2048 ], [ %rd2 + 0 ], 0x10, {policy};" in out
    assert "cp.async.ca.shared.global [ %r4 + 0 ], [ %rd3 + 0 ], 0x4, %r5;" in out   # 4-byte: left alone
    assert l2_hint.add_evict_first_hint(out) == out                                   # nothing left to hint
    assert l2_hint.cp_async_counts(PTX) == (2, 0) and l2_hint.cp_async_counts(out) == (2, 2)


@pytest.mark.parametrize("before", [False, True])
def test_the_policy_is_declared_in_the_kernel_entry_not_in_a_function(before):
    """A .func (a noinline function) with its own .reg lines, defined before or after the kernel, is left as
    it is: the policy register goes to the kernel entry, which uses it."""
    func = ".func helper(\n\t.param .b64 a\n)\n{\n\t.reg .b32 \t%r<3>;\n\tret;\n}\n"
    hinted = l2_hint.add_evict_first_hint(PTX)
    out = l2_hint.add_evict_first_hint(func + PTX if before else PTX + func)
    assert out == (func + hinted if before else hinted + func)


def test_ptx_without_cp_async_comes_back_unchanged():
    ptx = PTX.replace("cp.async.cg", "ld.global.v4")
    assert l2_hint.add_evict_first_hint(ptx) == ptx


def test_only_a_kernel_whose_every_async_copy_asked_gets_the_hint():
    first = "%k = ttg.async_copy_global_to_local %a, %b mask %m evictionPolicy = evict_first {c} : x -> y"
    plain = "%v = ttg.async_copy_global_to_local %a, %b mask %m {c} : x -> y"
    assert l2_hint.wants_evict_first(f"{first}\n{first}")
    assert not l2_hint.wants_evict_first(f"{first}\n{plain}")
    assert not l2_hint.wants_evict_first("%x = tt.load %p evictionPolicy = evict_first")   # no async copy


def test_ptxas_version_and_the_fixed_one():
    text = "Cuda compilation tools, release 13.4, V13.4.59\nBuild cuda_13.4.r13.4/compiler.38657139_0"
    assert l2_hint.ptxas_version(text) == (13, 4, 59) >= l2_hint.FIXED_PTXAS
    assert l2_hint.ptxas_version("release 12.8, V12.8.93") < l2_hint.FIXED_PTXAS
    with pytest.raises(ValueError):
        l2_hint.ptxas_version("no version here")


class _Stages(dict):
    """A compile's stages: ttgir returns text with one evict-first async copy; ptx returns PTX."""

    def __init__(self, ttgir_text):
        super().__init__(ttir=lambda src, md: src, ttgir=lambda src, md: ttgir_text,
                         ptx=lambda src, md: PTX, cubin=lambda src, md: b"")

    def run(self, name):
        md = {"name": name}
        self["ttgir"](None, md)
        return self["ptx"](None, md)


@pytest.mark.parametrize("name,asked,fixed,hinted", [
    ("_paged_decode_stage1", True, True, True),
    ("_paged_decode_stage1", True, False, False),    # ptxas < 13.4.59 would miscompile it
    ("_paged_decode_stage1", False, True, False),    # the config did not ask
    ("someone_elses_kernel", True, True, False),     # only our kernels
])
def test_hook_patches_only_when_asked_fixed_and_ours(monkeypatch, name, asked, fixed, hinted):
    monkeypatch.setattr(l2_hint, "ptxas_keeps_cp_async_policy", lambda arch: fixed)
    calls = []
    hook = l2_hint._stages_hook(lambda *args: calls.append(args))
    ttgir = "ttg.async_copy_global_to_local %a, %b" + (" evictionPolicy = evict_first" if asked else "")
    stages = _Stages(ttgir)
    hook(None, stages, None, None, 90)
    assert len(calls) == 1                               # a hook installed before ours still runs
    assert ("L2::cache_hint" in stages.run(name)) == hinted


@pytest.mark.parametrize("version,fixed,kept", [
    ("3.6.0", True, True),       # through our hook
    ("3.6.0", False, False),     # the hook stays out: ptxas 12.8 would miscompile it
    ("3.8.0", True, False),      # drops it and is not patched
    ("3.9.0", True, True),       # writes it itself
    ("3.10.1", True, True),
    ("3.9.0", False, False),
])
def test_cp_async_hint_compiles_by_triton_and_ptxas(monkeypatch, version, fixed, kept):
    monkeypatch.setattr(l2_hint, "ptxas_keeps_cp_async_policy", lambda arch: fixed)
    monkeypatch.setattr(triton, "__version__", version)
    assert l2_hint.cp_async_hint_compiles(90) == kept


def test_install_only_on_the_triton_that_drops_the_hint(monkeypatch):
    monkeypatch.setattr(triton.knobs.runtime, "add_stages_inspection_hook", None)
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert not l2_hint.install() and triton.knobs.runtime.add_stages_inspection_hook is None
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert l2_hint.install()
    hook = triton.knobs.runtime.add_stages_inspection_hook
    assert l2_hint.install() and triton.knobs.runtime.add_stages_inspection_hook is hook   # once


@pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="this Triton build has no NVIDIA backend tools")
def test_patched_decode_kernel_ptx_assembles(tmp_path):
    """The shipped split config compiled without the hint, patched here, assembles under the ptxas Triton
    uses for sm_90 into as many cp.async (LDGSTS) as before."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "kernels.sass_probe", "--shape", "1x32768", "--workspace",
                          "--config", "64,4,3", "--flags", "heads_fastest,early_table,pdl",
                          "--dump", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    ptx = l2_hint.add_evict_first_hint((tmp_path / "stage1.ptx").read_text())
    assert ptx.count("cp.async.cg.shared.global.L2::cache_hint") == ptx.count("cp.async.cg.shared.global") > 0
    (tmp_path / "hinted.ptx").write_text(ptx)
    from triton.backends.nvidia.compiler import get_ptxas
    cubin = tmp_path / "hinted.cubin"
    subprocess.run([get_ptxas(90).path, "-arch=sm_90a", str(tmp_path / "hinted.ptx"), "-o", str(cubin)],
                   check=True, capture_output=True, timeout=300)
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    before = (tmp_path / "stage1.sass").read_text()
    assert len(re.findall(r"LDGSTS", sass)) == len(re.findall(r"LDGSTS", before)) > 0
