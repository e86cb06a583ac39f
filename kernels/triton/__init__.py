"""The Triton kernel family (CUDA): decode/verify (split-KV with GQA packing) and extend."""

from __future__ import annotations


def supports(problem) -> bool:
    """Whether the Triton kernels express this problem. None exist yet: the torch family runs."""
    return False


def run(mode: str, tensors: dict, *, out, lse, scratch, options: dict, plan: dict) -> None:
    raise NotImplementedError("paged_attention: the Triton family has no kernels yet")


def precompile(problem, plan, options: dict) -> None:
    """Compiles the kernels of one plan ahead of any launch."""
