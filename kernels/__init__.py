"""Kernel families behind the plans' entry ops.

`run_entry` is where an entry op (`torch.ops.b12x.paged_attention_{decode,verify,extend}`) reaches a
kernel: the plan's family picks the module, the mode picks its function.
- reference.py: the fp32 executable definition of the semantics (tests compare everything with it)
- torch_impl.py: the vectorized torch family (CPU, and CUDA where no kernel supports a problem)
- triton/: the Triton family (CUDA)
- cute/: the CuTe DSL family (Hopper)
"""

from __future__ import annotations


def run_entry(mode: str, family: str, tensors: dict, *, out, lse, scratch, options: dict, plan: dict) -> None:
    """Runs one plan. tensors: q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, kv_start,
    sinks, k_descale, v_descale; options: kv_layout, causal, scale, window_left, softcap; plan: the
    Plan's tile constants (num_splits, block_m, block_n, num_warps, num_stages)."""
    if family == "torch":
        from b12x_inductor.kernels.torch_impl import paged_attention_torch

        paged_attention_torch(**tensors, out=out, lse=lse, **options)
    elif family == "triton":
        from b12x_inductor.kernels import triton as triton_kernels

        triton_kernels.run(mode, tensors, out=out, lse=lse, scratch=scratch, options=options, plan=plan)
    elif family == "cute":
        from b12x_inductor.kernels import cute as cute_kernels

        cute_kernels.run(mode, tensors, out=out, lse=lse, scratch=scratch, options=options, plan=plan)
    else:
        raise ValueError(f"paged_attention: plan family must be 'torch', 'triton' or 'cute'; got {family!r}")


def precompile(problem, plan, options: dict) -> None:
    """Compiles the plan's kernels ahead (called by the lowering while Inductor compiles the graph, and by
    `b12x_inductor.warmup`), so that no JIT compile ever happens inside a CUDA-graph capture."""
    if plan.family == "triton":
        from b12x_inductor.kernels import triton as triton_kernels

        triton_kernels.precompile(problem, plan, options)
    elif plan.family == "cute":
        from b12x_inductor.kernels import cute as cute_kernels

        cute_kernels.precompile(problem, plan, options)
