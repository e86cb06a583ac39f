"""Automatic op substitution: `torch.compile(model)` runs attention on `torch.ops.b12x.paged_attention`
wherever the result is provably the same as `F.scaled_dot_product_attention`'s.

    import b12x_inductor
    b12x_inductor.enable()                 # or: with b12x_inductor.substituting(): ...
    model = torch.compile(model)           # compiled after enable()
    model(...)
    for d in b12x_inductor.last_decisions():
        print(d)                           # substituted / left alone, and why

Substituted (lowering/substitute.py has the details): causal or unmasked self-attention over dense K/V
[B, Hkv, L, D] (GQA by enable_gqa or the repeat_kv / repeat_interleave idiom), and the static-cache decode
idiom, where a mask built from the cache positions (`arange(L) <= input_pos`, transformers' sdpa mask)
is proven "causal up to the position": the op then reads only the live keys, position + 1, computed on the
device (no recompile, no host sync); a proven sliding window on top is kept. Several queries at runtime
positions qualify where the keys are written at those positions (the write proves they fit the buffer).
A mask whose values only the device knows (a padding mask from a graph input, gpt-fast's
`causal_mask[None, None, input_pos]`, torchtune's mask argument, transformers' sdpa masks with padding) is
handed to the op as its `key_mask` and read by the kernel, exact for any values: any bool mask the same
for every head, and its additive 0 / -inf (or cuDNN's -65504) conversions. The keys read are the range
between the first and last key some query of the request sees, computed on the device.
Everything else is left exactly as it was, for example a finfo.min or arbitrary additive mask, a mask
that differs per head, dropout, an unsupported head dim or dtype (fp32 on CUDA).

The pass runs when Inductor compiles a graph: enable it before compiling (a graph compiled while it was
off stays so until torch._dynamo.reset()). On/off enters Inductor's FX-cache key, so a cached graph is
never reused across the switch. A graph served from that cache (another process, the serving engine's
compile cache) is not analyzed again: the decisions of the compile that made it come back with it
(`Decision.from_cache`), in `last_decisions()` and the log. Decisions also go to the logger
"b12x_inductor.substitute" (INFO).
"""

from __future__ import annotations

import contextlib

from b12x_inductor.lowering import cache as _cache
from b12x_inductor.lowering.substitute import REWRITE as _REWRITE, Decision

__all__ = ["enable", "disable", "is_enabled", "substituting", "last_decisions", "Decision"]

if _REWRITE not in _cache.GRAPH_PASS.rewrites:
    _cache.GRAPH_PASS.rewrites.append(_REWRITE)


def enable() -> None:
    """Turns the substitution on for graphs compiled from now on."""
    _REWRITE.enabled = True


def disable() -> None:
    """Turns it off for graphs compiled from now on."""
    _REWRITE.enabled = False


def is_enabled() -> bool:
    return _REWRITE.enabled


@contextlib.contextmanager
def substituting(enabled: bool = True):
    """Context manager: the substitution on (or off) inside, the previous state after."""
    previous = _REWRITE.enabled
    _REWRITE.enabled = enabled
    try:
        yield
    finally:
        _REWRITE.enabled = previous


def last_decisions() -> tuple[Decision, ...]:
    """One Decision (node, op, substituted, reason) per attention call of the most recent compiled graph
    that had any."""
    return _REWRITE.last
