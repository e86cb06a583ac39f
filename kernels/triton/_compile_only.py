"""The one module that touches Triton's private APIs: compiling for a GPU this machine need not have (CI: no
GPU at all), and loading a compiled kernel ahead of its first launch.

`precompile_for(problem, plan, options, cc)` compiles (`triton.compile` of an `ASTSource` for a `GPUTarget`)
the same arguments and constants that `precompile` hands to `JITFunction.warmup` on a GPU
(kernels/triton/__init__.py: `_launch`), for compute capability `cc` (80, 89, 90, 100, 120 ...) instead of
the current device. No kernel is loaded or run; the result's metadata says what it needs (shared memory,
registers). `load_now(kernel)` loads a warmed-up kernel's module (`CompiledKernel._init_handles`), which
Triton otherwise does at the first launch, possibly inside a CUDA-graph capture.
"""

from __future__ import annotations

import torch

_POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
            torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv"}


def _scalar_type(value) -> str:
    if isinstance(value, torch.dtype):
        return _POINTER[value]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"compile-only: no Triton type for argument {value!r}")


def compile_kernel(kernel, args: tuple, consts: dict, tune: dict, cc: int):
    """Compiles one `@triton.jit` kernel for the arguments `kernel.warmup(*args, **consts, **tune)` would
    take (pointers given as torch dtypes), for CUDA compute capability `cc` (major * 10 + minor)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    values = dict(zip(kernel.arg_names, args))
    values.update(consts)
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = _scalar_type(value)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(tune))


def precompile_for(problem, plan, options, cc: int) -> list:
    """The compiled kernels (split and merge, or extend) of one Triton plan (a Plan, with an Options), for
    compute capability `cc`."""
    from b12x_inductor.kernels import triton as triton_kernels

    return triton_kernels._launch(
        triton_kernels.warmup_launch(problem, options), plan, options, warmup=True,
        compile_with=lambda kernel, args, consts, tune: compile_kernel(kernel, args, consts, tune, cc))


def load_now(kernel) -> None:
    """Loads a compiled kernel's module now (Triton's private `_init_handles`; absent in some versions, where
    the load stays lazy)."""
    init = getattr(kernel, "_init_handles", None)
    if init is not None:
        init()
