"""The L2 evict-first hint on the decode kernel's cp.async loads, on Triton versions that drop it.

Why: a decode call streams every K/V byte through L2 once. Loaded with an evict-first policy, those lines
are the first to leave L2, so the stream does not push out what other work left there; lines left dirty (by
do_bench's cache clear, or by the previous layer's writes) would otherwise be written back to HBM during the
call (docs/kernel_notes.md runs 22, 23 and 25).

What Triton does: `tl.load(..., eviction_policy="evict_first")` keeps `evictionPolicy = evict_first` on the
pipelined `ttg.async_copy_global_to_local` up to the TTGIR. Triton 3.9 lowers it to
`cp.async.cg.shared.global.L2::cache_hint [dst], [src], 16, n, policy` with one
`createpolicy.fractional.L2::evict_first.b64 policy, 1.0`; Triton 3.6 drops the hint (a plain
`cp.async.cg.shared.global`).

Why Triton dropped it: ptxas before 13.4.59 miscompiles a fractional cache policy on cp.async. It drops the
`createpolicy` and leaves the LDGSTS reading an uninitialised uniform register as its cache descriptor, an
illegal instruction at run time (triton-lang/triton#11660 and #11848, IST-DASLab/marlin#44). We hit it on the
H200 with Triton 3.6's ptxas 12.8 (run 25); the offline SASS shows `desc[UR1]` with UR1 never written.

What this module does on Triton 3.6 (the GPU machine's): through `knobs.runtime.add_stages_inspection_hook`
it wraps two compile stages of our decode kernel and writes into its PTX what 3.9 writes, but only when the
ptxas Triton will run is 13.4.59 or newer (e.g. `TRITON_PTXAS_PATH` pointing at a CUDA 13.4 ptxas; Triton
3.6's own is 12.8, so by default nothing changes). It acts only when every async copy in the kernel's TTGIR
asked for evict_first, so no load gets a hint it did not ask for, and only on kernels named in
PATCHED_KERNELS. Other Triton versions are left alone: 3.9 emits the hint itself (for PTX 9.4+, which needs a
fixed ptxas) and calls the hook with another signature.
"""

from __future__ import annotations

import re

import triton

PATCHED_KERNELS = ("_paged_decode_stage1",)
PATCHED_TRITON = ("3.6.",)
EMITTING_TRITON = (3, 9)    # first Triton writing the policy on cp.async itself (PTX 9.4+, fixed ptxas)
FIXED_PTXAS = (13, 4, 59)   # first ptxas that keeps a fractional cache policy on cp.async
POLICY_REG = "%l2_evict_first"

_ASYNC_COPY = re.compile(r"ttg\.async_copy_global_to_local\b[^\n]*")
_CP_ASYNC_16 = re.compile(r"cp\.async\.cg\.shared\.global[^;]*0x10")
_CP_ASYNC_HINTED = re.compile(r"cp\.async\.cg\.shared\.global\.L2::cache_hint")
# a 16-byte cp.async without a cache hint: [dst], [src], 16{, src-size}
_CP_ASYNC = re.compile(
    r"cp\.async\.cg\.shared\.global(\s+\[[^\]]*\],\s*\[[^\]]*\],\s*0x10(?:,\s*%r\d+)?)\s*;")
# the kernel entry's register declarations: the run of `.reg` lines that opens its body (Triton's PTX may also
# hold .func bodies, e.g. of a noinline function, before or after it, with their own)
_ENTRY_REG_DECLS = re.compile(r"\.entry [^{]*\{(?:\s*\.reg [^\n]*;)+")


def wants_evict_first(ttgir: str) -> bool:
    """True when the module has async copies and every one of them carries evictionPolicy = evict_first."""
    copies = _ASYNC_COPY.findall(ttgir)
    return bool(copies) and all("evictionPolicy = evict_first" in c for c in copies)


def add_evict_first_hint(ptx: str) -> str:
    """The PTX with one evict-first L2 policy register and that policy on every hint-less 16-byte cp.async.

    Expects one kernel entry (Triton's PTX): the policy is declared after the `.reg` declarations that open
    its body and created before its first instruction. A cp.async outside the entry (in a .func) would name a
    register it does not have, which ptxas rejects: loud, never a copy silently left without its hint. PTX
    that has no such cp.async comes back unchanged.
    """
    if not _CP_ASYNC.search(ptx):
        return ptx
    decls = _ENTRY_REG_DECLS.search(ptx)
    if not decls:
        raise ValueError("no kernel entry with .reg declarations to add the L2 policy register after")
    declare = f"\n\t.reg .b64 \t{POLICY_REG};"
    create = f"\n\tcreatepolicy.fractional.L2::evict_first.b64 \t{POLICY_REG}, 1.0;"
    ptx = ptx[:decls.end()] + declare + create + ptx[decls.end():]
    return _CP_ASYNC.sub(rf"cp.async.cg.shared.global.L2::cache_hint\1, {POLICY_REG};", ptx)


def cp_async_counts(ptx: str) -> tuple[int, int]:
    """(16-byte cp.async copies, those carrying an L2 cache hint) in a PTX text."""
    return len(_CP_ASYNC_16.findall(ptx)), len(_CP_ASYNC_HINTED.findall(ptx))


def ptxas_version(version_text: str) -> tuple[int, int, int]:
    """(major, minor, patch) from `ptxas --version` output ("... release 13.4, V13.4.59")."""
    m = re.search(r"V(\d+)\.(\d+)\.(\d+)", version_text)
    if not m:
        raise ValueError(f"no ptxas version in {version_text!r}")
    return tuple(int(x) for x in m.groups())


def ptxas_version_for(arch: int) -> tuple[int, int, int]:
    """Version of the ptxas Triton runs for sm_<arch> (its own, or TRITON_PTXAS_PATH's)."""
    from triton.backends.nvidia.compiler import get_ptxas_version
    return ptxas_version(get_ptxas_version(arch))


def ptxas_keeps_cp_async_policy(arch: int) -> bool:
    """True when the ptxas Triton runs for sm_<arch> compiles a cache policy on cp.async correctly."""
    return ptxas_version_for(arch) >= FIXED_PTXAS


def cp_async_hint_compiles(arch: int) -> bool:
    """Whether a cp.async load that asks for evict_first keeps it in the kernel compiled for sm_<arch>: on
    Triton 3.6 through this module's hook, on Triton >= 3.9 by itself, both only with a fixed ptxas. 3.7.1
    and 3.8.0 write plain cp.async (offline PTX of our split config)."""
    major_minor = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    emits = triton.__version__.startswith(PATCHED_TRITON) or major_minor >= EMITTING_TRITON
    return emits and ptxas_keeps_cp_async_policy(arch)


def _stages_hook(previous):
    """An add_stages_inspection_hook (Triton 3.6 signature) that chains `previous` and wraps ttgir/ptx."""

    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        if "ttgir" not in stages or "ptx" not in stages:
            return
        make_ttgir, make_ptx = stages["ttgir"], stages["ptx"]
        seen = {"evict_first": False}    # one compile: stages run in order, ttgir before ptx

        def ttgir(src, metadata):
            module = make_ttgir(src, metadata)
            # printing the module costs a little per compile: only where the hint could be written at all
            seen["evict_first"] = (ptxas_keeps_cp_async_policy(capability)
                                   and wants_evict_first(str(module)))
            return module

        def ptx(src, metadata):
            text = make_ptx(src, metadata)
            if seen["evict_first"] and metadata.get("name") in PATCHED_KERNELS:
                text = add_evict_first_hint(text)
            return text

        stages["ttgir"], stages["ptx"] = ttgir, ptx

    hook.pagewalk_l2_hint = True
    return hook


def install() -> bool:
    """Install the hook once, on the Triton versions that need it; True when it is installed."""
    if not triton.__version__.startswith(PATCHED_TRITON):
        return False
    runtime = triton.knobs.runtime
    current = runtime.add_stages_inspection_hook
    if not getattr(current, "pagewalk_l2_hint", False):
        runtime.add_stages_inspection_hook = _stages_hook(current)
    return True
