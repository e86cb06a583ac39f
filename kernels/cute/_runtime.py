"""The CuTe DSL runtime's private entry points, in one module: a compiled kernel launched from arguments that were
marshalled once.

A function that `cute.compile` returns marshals every argument again at every call (`generate_execution_args`:
about a microsecond an argument on the CPU machine; a float8 decode launch has 37), then runs its compiled
program on the C pointers that gave. The family makes each launch value once (`__init__.py`: pointers by
address, scalars by value, streams by handle), so an `Arg` marshals it once too: the value beside its one C
pointer, what the DSL's JIT-argument protocol (`__c_pointers__`) gives for it, or a CUDA stream's handle address
(what the DSL's stream adapter passes). `launch` hands those to the function's `run_compiled_program`, the step its
`__call__` takes after marshalling.

Contract: an Arg's pointer points into memory its value owns (a cute Pointer's ctypes descriptor, the ctypes value
a Numeric's owning pointer keeps, a CUstream's handle), so it stays valid while the Arg lives; the launch reads
the arguments before it returns (the C API copies them into the kernel launch). A scalar's Arg must be of its
parameter's annotated type (`__init__._launch_args` makes it so from the signature): `__call__` would cast it,
`launch` does not. Where the compiled function is not one this module knows how to drive (another DSL version,
or a test's stand-in), `launch` calls it with the values, which marshals them as before.
"""

from __future__ import annotations

import functools
from typing import NamedTuple


class Arg(NamedTuple):
    """One launch argument: the DSL value and its C pointer."""

    value: object
    c: object


def arg(value) -> Arg:
    """Marshals one DSL value (a cute Pointer, an Int32 / Int64 / Float32, a CUstream)."""
    if hasattr(value, "__c_pointers__"):
        pointers = value.__c_pointers__()
    else:  # a CUDA handle (the DSL's CudaHandleAdapter: its getPtr())
        pointers = [value.getPtr()]
    if len(pointers) != 1:
        raise TypeError(f"CuTe launch: one C pointer expected for {type(value).__name__}; got {len(pointers)}")
    return Arg(value, pointers[0])


@functools.lru_cache(maxsize=64)
def _direct(compiled) -> bool:
    """Whether `compiled` takes the marshalled pointers directly: the DSL's JIT-compiled function with no
    per-call validation that `__call__` would run (a recorded spec, the full argument check) and no argument
    slot that converts Python pointer addresses (each Arg is then exactly what `generate_execution_args` makes)."""
    execution_args = getattr(compiled, "execution_args", None)
    specs = getattr(execution_args, "_pointer_address_arg_specs", None)
    return (callable(getattr(compiled, "run_compiled_program", None))
            and getattr(compiled, "_pyir_spec", True) is None
            and getattr(execution_args, "_full_arg_check", True) is False
            and specs is not None and all(s is None for s in specs))


def launch(compiled, args: list[Arg]) -> None:
    """Launches `compiled` (a `cute.compile` result) with `args` in its signature's order."""
    if _direct(compiled):
        compiled.run_compiled_program([a.c for a in args])
    else:
        compiled(*(a.value for a in args))
