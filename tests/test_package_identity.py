"""The top-level `kernels` module is pagewalk's: Hugging Face's `kernels` distribution (a dependency of
transformers >= 5.25) installs a module of the same name, and the server says so instead of failing on a
missing attribute deep in its imports."""

from __future__ import annotations

import shutil
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


def test_a_foreign_init_over_pagewalks_files_is_named_at_import(tmp_path):
    """Hugging Face's `kernels` installed after a wheel install of pagewalk replaces kernels/__init__.py and
    leaves the other files: a check by file alone passed it (a review)."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "kernels", site / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = object\n")
    code = f"import sys; sys.path[:0] = [{str(site)!r}, {str(REPO)!r}]; import server"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    assert out.returncode != 0 and "is not pagewalk's" in out.stderr, out.stderr[-500:]
