"""Inductor integration: the paged-attention lowering and the project's graph pass.

Importing this module (which `import b12x_inductor` does) registers the lowering of
`torch.ops.b12x.paged_attention` and installs `cache.GRAPH_PASS` into Inductor's post-grad custom passes,
so Inductor's FX graph cache key covers the project's sources.
"""

from . import _inductor, cache, paged_attention

paged_attention.register()
_inductor.install_graph_pass(cache.GRAPH_PASS)
