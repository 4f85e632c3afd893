"""pagewalk's server: the HTTP API, the engine core, the model.

Importing the package loads nothing heavy: `pagewalk serve` sets its SIGTERM handler before torch and
Triton load (~3 s), so a stop asked for then ends it cleanly too. The top-level `kernels` module is checked
to be this project's by a file it holds, without importing it."""

import importlib.util as _util
from pathlib import Path as _Path


def _is_pagewalks(where: str) -> bool:
    """Whether the `kernels` package at `where` is this project's: its own module file, and an __init__
    that exports the dispatch (another package's __init__ over pagewalk's files, as installing Hugging
    Face's `kernels` after a wheel install of pagewalk leaves them, passed a file check alone: a review)."""
    init = _Path(where) / "__init__.py"
    return (_Path(where) / "paged_decode.py").is_file() and init.is_file() and \
        "paged_decode_attention" in init.read_text(errors="replace")


_spec = _util.find_spec("kernels")
if _spec is not None and not any(_is_pagewalks(p) for p in _spec.submodule_search_locations or ()):
    _where = _spec.origin or list(_spec.submodule_search_locations or ())
    raise ImportError(
        f"the module 'kernels' found at {_where} is not pagewalk's: Hugging Face's `kernels` package (a "
        "dependency of transformers >= 5.25) installs a module of the same name. Uninstall it (`pip "
        "uninstall kernels`; pagewalk's tests pin transformers < 5.25).")
