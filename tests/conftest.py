import pytest
import torch

from b12x_inductor._kernels_shadow import load_installed_kernels

load_installed_kernels()  # before any test imports transformers (the module says why)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
