import os

import pytest
import torch

from b12x_inductor._kernels_shadow import load_installed_kernels

load_installed_kernels()  # before any test imports transformers (the module says why)


def _share_cpu_threads():
    """Under pytest-xdist each worker takes cores // workers intra-op threads. torch's default, every core in
    each worker, oversubscribes the CPU: on the GPU machine (16 cores, 12 workers) the fp32 reference of a
    150-request decode case took 235 s, where one thread on a CPU machine takes 9.5 s (h200.md, "Session 53")."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_cpu_threads()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
