"""Every private torch API the project uses (Inductor's, and one of the dispatcher's), in one small module
(tested on torch 2.11 and 2.13).

- `register_lowering(op, fn)`: `user_lowerings` where it exists (2.12+), else the global `lowerings`.
- `empty(size, dtype, device)`: an Inductor-allocated buffer (from the CUDA-graph pool under cudagraphs).
- `call_fallback(op, *args, **kwargs)`: emit one call of an op into the generated code.
- `static_int(expr)`: a static size; a symbolic one is guarded (specialized) to its current value.
- `install_graph_pass(p)`: add a CustomGraphPass to post_grad_custom_pre_pass (a list from 2.13, one
  pass before), so its uuid() enters Inductor's FX graph cache key.
- `fake_mode_of(values)`: the FakeTensorMode behind a graph's metadata (to give new nodes their "val").
- `redispatch_below_autograd(overload, keyset, *args, **kwargs)`: what an Autograd kernel registered
  with_keyset=True calls after its checks (the ops' no-backward kernels in ops.py).
"""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
import torch._inductor.lowering as inductor_lowering
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # noqa: F401
from torch._inductor.virtualized import V


def register_lowering(op: torch._ops.OpOverload, fn) -> None:
    table = getattr(inductor_lowering, "user_lowerings", None)
    if table is None:
        table = inductor_lowering.lowerings
    table[op] = fn


def empty(size, dtype: torch.dtype, device: torch.device):
    return inductor_lowering.empty_strided(list(size), None, dtype=dtype, device=device)


def call_fallback(op: torch._ops.OpOverload, *args, **kwargs):
    return inductor_lowering.fallback_handler(op, add_to_fallback_set=False)(*args, **kwargs)


def static_int(expr) -> int:
    return int(V.graph.sizevars.guard_int(expr))


class _Chain(CustomGraphPass):
    """Two passes run in order, with a uuid built from both (torch < 2.13 takes one pass)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self):
        a, b = self.first.uuid(), self.second.uuid()
        return None if a is None or b is None else f"{a}|{b}"


def install_graph_pass(p: CustomGraphPass) -> None:
    current = inductor_config.post_grad_custom_pre_pass
    if current is p or (isinstance(current, (list, tuple)) and p in current):
        return
    if isinstance(current, list):
        current.append(p)
    elif isinstance(current, tuple):
        inductor_config.post_grad_custom_pre_pass = [*current, p]
    elif current is None:
        inductor_config.post_grad_custom_pre_pass = [p] if torch.__version__ >= (2, 13) else p
    else:
        inductor_config.post_grad_custom_pre_pass = _Chain(current, p)


def fake_mode_of(values):
    """The FakeTensorMode of a graph's metadata tensors (node.meta["val"]), or None."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])


def redispatch_below_autograd(overload: torch._ops.OpOverload, keyset, *args, **kwargs):
    """Calls `overload` with the dispatch keys below Autograd: outputs claim no gradient."""
    with torch._C._AutoDispatchBelowAutograd():
        return overload.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)
