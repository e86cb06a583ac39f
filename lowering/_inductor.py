"""Every private torch API the project uses (Inductor's, and one of the dispatcher's), in one small module
(tested on torch 2.11 and 2.13).

- `register_lowering(op, fn)`: `user_lowerings` where it exists (2.12+), else the global `lowerings`.
- `empty(size, dtype, device)`: an Inductor-allocated buffer (from the CUDA-graph pool under cudagraphs).
- `call_fallback(op, *args, **kwargs)`: emit one call of an op into the generated code.
- `static_int(expr)`: a static size; a symbolic one is guarded (specialized) to its current value.
- `is_prefix_view(a, b)`: whether IR tensor b is a's storage at a's offset and strides, only the last dim
  narrower (the lowering's Problem.v_in_k); False whenever the IR does not say so for certain.
- `install_graph_pass(p)`: add a CustomGraphPass to post_grad_custom_pre_pass (a list from 2.13, one
  pass before), so its uuid() enters Inductor's FX graph cache key.
- `fake_mode_of(values)`: the FakeTensorMode behind a graph's metadata (to give new nodes their "val").
- `redispatch_below_autograd(overload, keyset, *args, **kwargs)`: what an Autograd kernel registered
  with_keyset=True calls after its checks (the ops' no-backward kernels in ops.py).
- `compile_stats()`: a snapshot of Dynamo's and Inductor's process-wide compile counters and timers (the
  serving engine reports their deltas per bucket).
- `cache_dir(path)`: Inductor's and Triton's on-disk caches in `path` for a block (the engine's compile cache).
- `more_recompiles(entries)`: Dynamo's recompile limits raised by `entries` for a block (the engine's and
  the benchmarks' warm-ups compile one entry per bucket of the same code), scoped, never process-wide.
- `count_in_cache_entry(key)`: counts `key` in counters["inductor"], whose deltas over one compile Inductor
  stores with that graph's FX cache entry and adds back (unpickling the key) when a later process loads it.
"""

from __future__ import annotations

import contextlib
import os

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


def is_prefix_view(a, b) -> bool:
    from torch._inductor import ir

    try:
        la, lb = a.get_layout(), b.get_layout()
        if not (isinstance(la, ir.FixedLayout) and isinstance(lb, ir.FixedLayout)):
            return False  # a layout Inductor may still choose
        same = (a.get_name() == b.get_name() and a.get_dtype() == b.get_dtype() and la.offset == lb.offset
                and len(la.stride) == len(lb.stride) and all(x == y for x, y in zip(la.stride, lb.stride))
                and len(la.size) == len(lb.size) and all(x == y for x, y in zip(la.size[:-1], lb.size[:-1])))
        return bool(same) and static_int(lb.size[-1]) <= static_int(la.size[-1])
    except (AttributeError, NotImplementedError, TypeError):
        return False


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


def compile_stats() -> dict[str, float]:
    """Process-wide totals so far: Dynamo graphs compiled (`graphs`), Inductor FX graph cache hits, misses
    and bypasses (`fx_hit`, `fx_miss`, `fx_bypass`: a miss is an Inductor compile), AOTAutograd cache hits
    and misses (`aot_hit`, `aot_miss`), and seconds spent in Dynamo (`dynamo_s`: tracing, guards, bytecode)
    and in the backend it calls (`backend_s`: AOTAutograd and Inductor, cache loads and Triton/C++ builds
    included). Differences of two snapshots attribute the work between them; a name that a torch version
    does not record counts 0."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    def seconds(name: str) -> float:
        return float(sum(compilation_time_metrics.get(name, ())))

    inductor, aot = counters["inductor"], counters["aot_autograd"]
    backend = seconds("OutputGraph.call_user_compiler")
    return dict(graphs=counters["stats"]["unique_graphs"], fx_hit=inductor["fxgraph_cache_hit"],
                fx_miss=inductor["fxgraph_cache_miss"], fx_bypass=inductor["fxgraph_cache_bypass"],
                aot_hit=aot["autograd_cache_hit"], aot_miss=aot["autograd_cache_miss"],
                dynamo_s=max(0.0, seconds("_compile.compile_inner") - backend), backend_s=backend)


@contextlib.contextmanager
def cache_dir(path: str):
    """Inductor's on-disk caches (FX graphs, AOTAutograd entries, C++ builds) in `path` and Triton's in
    `path`/triton for the block (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, which Inductor passes on to
    its compile workers), then the previous values; Inductor's in-memory memos of cache paths are cleared on
    entry and exit."""
    from torch._inductor.utils import clear_caches

    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    old = {name: os.environ.get(name) for name in names}
    path = os.path.abspath(path)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")
    clear_caches()
    try:
        yield path
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        clear_caches()


def more_recompiles(entries: int):
    """A context in which Dynamo's recompile limits are `entries` higher (and the accumulated limit 4x that):
    each bucket of a compiled function is one more cache entry of the same code object."""
    dyn = torch._dynamo.config
    return dyn.patch(recompile_limit=dyn.recompile_limit + entries,
                     accumulated_recompile_limit=dyn.accumulated_recompile_limit + 4 * entries)


def count_in_cache_entry(key) -> None:
    """Counts `key` (hashable, picklable) once in counters["inductor"] during the current compile: Inductor
    keeps the compile's counter deltas in its FX graph cache entry (CompiledFxGraph.counter_deltas) and, on a
    cache hit, adds them back, which unpickles `key` in the loading process."""
    from torch._dynamo.utils import counters

    counters["inductor"][key] += 1
