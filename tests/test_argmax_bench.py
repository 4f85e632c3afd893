"""tools/argmax_bench.py on CPU: the dry run checks both paths' ids against torch.argmax and prints the
table; without a GPU the real run refuses loudly instead of timing nothing."""

from __future__ import annotations

import json
import os

import pytest

from tools import argmax_bench


def test_without_cuda_the_bench_exits_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setattr(argmax_bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        argmax_bench.main(["--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs the interpreter")
def test_dry_run_checks_both_paths(tmp_path, capsys):
    argmax_bench.main(["--dry-run", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "argmax_cpu_dry_run.json").read_text())
    seen = {(r["S"], r["dtype"], r["path"]) for r in report["results"]}
    assert seen == {(S, d, p) for S in (1, 4) for d in ("float16", "float32") for p in ("torch", "kernel")}
    assert all(r["mismatches"] == 0 for r in report["results"])
    assert "torch/kernel" in capsys.readouterr().out.splitlines()[-5]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs the interpreter")
def test_dry_run_sweep_restores_the_shipped_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(argmax_bench.SWEEP, "BLOCK", (64, 128))
    monkeypatch.setitem(argmax_bench.SWEEP, "TARGET_PROGRAMS", (2, 512))
    shipped = {name: getattr(argmax_bench.argmax_mod, name) for name in argmax_bench.SWEEP}
    argmax_bench.main(["--dry-run", "--sweep", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "argmax_cpu_dry_run.json").read_text())
    assert len(report["sweep"]) == 2 * 2 * 2 * 2  # blocks x warps x targets x rows (1, 4)
    assert all(r["mismatches"] == 0 and r["dtype"] == "float16" for r in report["sweep"])
    assert {name: getattr(argmax_bench.argmax_mod, name) for name in argmax_bench.SWEEP} == shipped
    assert "kernel µs per call" in capsys.readouterr().out


def test_a_wrong_id_exits_non_zero(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(argmax_bench.PATHS, "kernel", lambda logits: logits.argmin(dim=-1))
    with pytest.raises(SystemExit, match="other than torch.argmax"):
        argmax_bench.main(["--dry-run", "--out", str(tmp_path)])
