"""Serving: continuous batching over a paged KV cache with chunked prefill, decode and prompt-lookup
speculative verify; the model forward is compiled once per static bucket.

Pieces (each a short module): `config.ServeConfig` (the static shape), `pages.PageAllocator` (the free
list), `scheduler.Scheduler` (which tokens run each step; preemption by recompute), `draft` (prompt-lookup
drafts), `runner.ModelRunner` (the compiled forward of a transformers causal LM over the paged pool),
`mla.absorb_mla` (DeepSeek-V3: its attention absorbed over a paged latent cache, installed by the runner),
`engine.Engine` (the loop and its report). CLI: `python -m b12x_inductor.serve --demo`.
"""

from b12x_inductor.serve.config import ServeConfig
from b12x_inductor.serve.engine import Engine, Report
from b12x_inductor.serve.scheduler import Request

__all__ = ["Engine", "Report", "Request", "ServeConfig"]
