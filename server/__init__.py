"""pagewalk's server: the HTTP API, the engine core, the model."""

import kernels as _kernels

if not hasattr(_kernels, "paged_decode_attention"):  # another distribution's top-level `kernels` module
    _where = getattr(_kernels, "__file__", None) or list(_kernels.__path__)
    raise ImportError(
        f"the module 'kernels' found at {_where} is not pagewalk's: Hugging Face's `kernels` package (a "
        "dependency of transformers >= 5.25) installs a module of the same name. Uninstall it (`pip "
        "uninstall kernels`; pagewalk's tests pin transformers < 5.25).")
