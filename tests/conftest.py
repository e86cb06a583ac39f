import importlib.metadata
import importlib.util
import os
import sys

import pytest
import torch


def _load_installed_kernels_package():
    """transformers 5.25 and later require the `kernels` distribution (Hugging Face's hub kernels) and import
    it with their integrations. The tests run from the checkout's root, where this project's `kernels/` source
    folder (installed as b12x_inductor.kernels) would be found first as a top-level `kernels`. The installed
    distribution's package is loaded under that name before anything imports transformers."""
    try:
        init = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    except importlib.metadata.PackageNotFoundError:
        return
    if "kernels" in sys.modules or not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location("kernels", init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules["kernels"]
        raise


_load_installed_kernels_package()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
