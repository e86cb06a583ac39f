"""Run from the checkout's root (the tests, `python -m b12x_inductor.bench`), this project's `kernels/` source
folder, installed as b12x_inductor.kernels, would also be found as a top-level `kernels`. transformers 5.25 and
later require the `kernels` distribution (Hugging Face's hub kernels) and import it with their integrations, so
they would import ours and fail (ImportError: CUDAProperties). `load_installed_kernels` loads the installed
distribution's package under that name first; it must run before anything imports transformers."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys


def load_installed_kernels() -> None:
    """Puts the installed `kernels` distribution's package into sys.modules as `kernels`; nothing where that
    distribution is not installed or `kernels` is already imported."""
    if "kernels" in sys.modules:
        return
    try:
        init = str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        return
    if not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location("kernels", init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise
