"""pagewalk's server: the HTTP API, the engine core, the model.

Importing the package loads nothing heavy: `pagewalk serve` sets its SIGTERM handler before torch and
Triton load (~3 s), so a stop asked for then ends it cleanly too. The top-level `kernels` module is checked
to be this project's by a file it holds, without importing it."""

import importlib.util as _util
from pathlib import Path as _Path

_spec = _util.find_spec("kernels")
if _spec is not None and not any((_Path(p) / "paged_decode.py").is_file()
                                 for p in _spec.submodule_search_locations or ()):
    _where = _spec.origin or list(_spec.submodule_search_locations or ())
    raise ImportError(
        f"the module 'kernels' found at {_where} is not pagewalk's: Hugging Face's `kernels` package (a "
        "dependency of transformers >= 5.25) installs a module of the same name. Uninstall it (`pip "
        "uninstall kernels`; pagewalk's tests pin transformers < 5.25).")
