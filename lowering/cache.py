"""Keeps Inductor's FX graph cache honest about this project's code.

Inductor's cache key does not hash lowerings, custom ops' Python implementations or their fakes, so a
changed lowering, plan table or kernel could be served from a stale compiled graph. `B12xGraphPass` is a
post-grad CustomGraphPass whose uuid() hashes every source file of the package (lowering, plans, kernels);
registering it puts that hash into the cache key. Graph rewrites that belong to the project run here too.
"""

from __future__ import annotations

import functools
from pathlib import Path

from . import _inductor

_PACKAGE_ROOTS = (
    Path(__file__).resolve().parent,  # lowering/
    Path(__file__).resolve().parent.parent / "kernels",  # kernels/ (installed as b12x_inductor.kernels)
)


@functools.cache
def _source_files() -> tuple[str, ...]:
    import b12x_inductor

    roots = (*_PACKAGE_ROOTS, Path(b12x_inductor.__file__).resolve().parent)
    return tuple(sorted({str(p) for root in roots if root.is_dir() for p in root.rglob("*.py")}))


@functools.cache
def source_hash() -> str:
    return _inductor.get_hash_for_files(_source_files()).hex()


class B12xGraphPass(_inductor.CustomGraphPass):
    """Runs the project's registered graph rewrites; its uuid is the hash of the project's sources."""

    def __init__(self) -> None:
        self.rewrites: list = []  # callables graph -> None, e.g. the attention substitution

    def __call__(self, graph) -> None:
        for rewrite in self.rewrites:
            rewrite(graph)

    def uuid(self) -> str:
        states = ",".join(getattr(r, "cache_state", lambda: type(r).__name__)() for r in self.rewrites)
        return f"b12x-{source_hash()}-{states}"


GRAPH_PASS = B12xGraphPass()
