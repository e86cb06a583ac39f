"""The one module that touches Triton's private APIs: compiling for a GPU this machine need not have (CI: no
GPU at all), loading a compiled kernel ahead of its first launch, and launching a compiled kernel directly.

`precompile_for(problem, plan, options, cc)` compiles (`triton.compile` of an `ASTSource` for a `GPUTarget`)
the same arguments and constants that `precompile` hands to `JITFunction.warmup` on a GPU
(kernels/triton/__init__.py: `_launch`), specialized as the JIT specializes them there, for compute
capability `cc` (80, 89, 90, 100, 120 ...) instead of the current device. No kernel is loaded or run; the result's metadata says what it needs (shared memory,
registers). `load_now(kernel)` loads a warmed-up kernel's module (`CompiledKernel._init_handles`), which
Triton otherwise does at the first launch, possibly inside a CUDA-graph capture. `direct_launcher` gives the
compiled kernel a JIT launch would run, as a launcher that skips the JIT's binder (Triton's `CompiledKernel[grid]`).
"""

from __future__ import annotations

import torch


def compile_kernel(kernel, args: tuple, consts: dict, tune: dict, cc: int):
    """Compiles one `@triton.jit` kernel for the arguments `kernel.warmup(*args, **consts, **tune)` would
    take (pointers given as torch dtypes), for CUDA compute capability `cc` (major * 10 + minor).

    Every argument is specialized as the JIT's binder specializes it at a launch on the GPU (Triton's
    `native_specialize_impl` with the target's backend, `_pack_args`' signature / constexprs / attrs): a pointer
    as 16-byte aligned (`tt.divisibility` 16: a stand-in tensor of its dtype, as torch's allocations are), an
    int as a multiple of 16 where it is one, as the constant 1 where it is 1, and neither where the kernel
    says do_not_specialize. Without those attributes Triton vectorizes no load whose address it cannot prove
    aligned, and the compiled kernel (registers, spills, shared memory) is not the one the GPU runs."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    values = dict(zip(kernel.arg_names, args))
    values.update(consts)
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            continue
        if isinstance(value, torch.dtype):
            value = torch.empty(16, dtype=value)  # a stand-in: its data pointer is 16-byte aligned
        kind, attr = native_specialize_impl(backend, value, param.is_const, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":  # an int specialized to its value (1)
            constexprs[param.name] = value
        elif isinstance(attr, str):
            attrs[(i,)] = backend.parse_attr(attr)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=dict(tune))


def precompile_for(problem, plan, options, cc: int) -> list:
    """The compiled kernels (split and merge, or extend) of one Triton plan (a Plan, with an Options), for
    compute capability `cc`."""
    from b12x_inductor.kernels import triton as triton_kernels

    return triton_kernels._launch(
        *triton_kernels.warmup_launch(problem, options), plan, options, warmup=True,
        compile_with=lambda kernel, args, consts, tune: compile_kernel(kernel, args, consts, tune, cc))


def load_now(kernel) -> None:
    """Loads a compiled kernel's module now (Triton's private `_init_handles`; absent in some versions, where
    the load stays lazy)."""
    init = getattr(kernel, "_init_handles", None)
    if init is not None:
        init()


def direct_launcher(kernel, grid: tuple, args: tuple, kwargs: dict):
    """(launch, tail) such that `launch(*args, *tail)` launches what `kernel[grid](*args, **kwargs)` launches, on
    the current device's current stream, without the JIT's binder (which specializes every argument again at
    every launch: about half of a small launch's host time). `args` are the kernel's leading (runtime) arguments,
    `kwargs` its trailing compile-time ones (constexprs) and num_warps / num_stages.

    The launcher is the CompiledKernel that the JIT picks for these very arguments (`kernel.warmup`), so it holds
    for every later launch whose arguments the JIT would specialize the same way: the same dtypes, the same ints,
    and pointers as 16-byte aligned as these (the caller's contract: `kernels/triton/__init__.py`'s `_Step`
    keeps one per device for launches whose pointers are all 16-byte aligned, and sends the rest through the
    JIT). Triton's launcher takes every parameter of the kernel, constexprs included, in the kernel's order:
    `tail` is the constexprs' values in that order."""
    rest = constexpr_tail(kernel, len(args), kwargs)
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    return compiled[tuple(grid) + (1,) * (3 - len(grid))], tuple(kwargs[n] for n in rest)


def constexpr_tail(kernel, num_args: int, kwargs: dict) -> tuple[str, ...]:
    """The names of a `@triton.jit` kernel's parameters after its first `num_args`, in its order: the constexprs
    a direct launch passes after the runtime arguments. TypeError unless those first parameters are all runtime
    ones and the rest are exactly the constexprs of `kwargs` (besides num_warps / num_stages)."""
    names = kernel.arg_names
    rest = tuple(names[num_args:])
    if any(p.is_constexpr for p in kernel.params[:num_args]) or set(rest) != set(kwargs) - {"num_warps", "num_stages"}:
        raise TypeError(f"{kernel.fn.__name__}: a direct launch takes the runtime arguments first and the constexprs "
                        f"after them by keyword; got {list(names[:num_args])} positional and {sorted(kwargs)} by "
                        f"keyword for parameters {list(names)}")
    return rest


def resource_usage(kernel) -> dict:
    """{"registers", "stack", "shared"} of a compiled kernel (per thread: registers and stack bytes, where
    spilled registers go; per block: static + dynamic shared bytes), from its cubin by the cuobjdump that
    ships with Triton's NVIDIA backend (`--dump-resource-usage`); no GPU needed."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", text))
    return dict(registers=int(found["REG"]), stack=int(found["STACK"]), shared=int(kernel.metadata.shared))
