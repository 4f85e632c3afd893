"""The top-level `kernels` module is pagewalk's: Hugging Face's `kernels` distribution (a dependency of
transformers >= 5.25) installs a module of the same name, and the server says so instead of failing on a
missing attribute deep in its imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_kernels_module_is_this_repositorys():
    import kernels

    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"


def test_a_foreign_kernels_module_is_named_at_import(tmp_path):
    foreign = tmp_path / "kernels"
    foreign.mkdir()
    (foreign / "__init__.py").write_text("CUDAProperties = object\n")
    code = f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(REPO)!r}]; import server"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    assert out.returncode != 0
    assert "is not pagewalk's" in out.stderr and "pip uninstall kernels" in out.stderr
