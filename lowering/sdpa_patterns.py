"""The forms scaled_dot_product_attention takes in a post-grad graph, and the GQA repeat idioms.

By the post-grad passes, `F.scaled_dot_product_attention` has become the backend op its dispatcher chose:
- CPU:  aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)
- CUDA: aten._scaled_dot_product_flash_attention (no mask), _efficient_attention (attn_bias: a bool mask
  arrives converted to an additive 0 / -inf tensor), _cudnn_attention (a bool mask arrives as
  `where(logical_not(mask), -65504.0, 0)`: see `cudnn_bool_mask`), or the math decomposition
  (matmuls and a softmax that zeroes fully masked rows: reported by `is_math_form`, never rewritten).
Each returns a tuple whose item 0 is the attention output [B, Hq, S, D]; the others (logsumexp, RNG state)
must be unused, as in inference graphs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

aten = torch.ops.aten

# backend op -> name of its mask argument (None: it takes no mask)
FORMS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten._scaled_dot_product_flash_attention.default: None,
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_fused_attention_overrideable.default: "attn_bias",
    aten.scaled_dot_product_attention.default: "attn_mask",
}


@dataclass(frozen=True, kw_only=True)
class SdpaCall:
    """One attention call in the graph: q [B, Hq, S, D], k and v [B, Hk, L, D] as SDPA received them."""

    node: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    output: fx.Node | None  # the node holding the attention output (getitem 0, or the node itself)
    other_outputs_used: bool


def match(node: fx.Node) -> SdpaCall | None:
    if node.op != "call_function" or node.target not in FORMS:
        return None
    kw = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    mask_name = FORMS[node.target]
    tuple_out = node.target is not aten.scaled_dot_product_attention.default
    output, others = (None, False) if tuple_out else (node, False)
    if tuple_out:
        for user in node.users:
            if user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0:
                output = user
            elif user.users or not (user.op == "call_function" and user.target is operator.getitem):
                others = True
    return SdpaCall(
        node=node, q=kw["query"], k=kw["key"], v=kw["value"], mask=kw.get(mask_name) if mask_name else None,
        dropout_p=float(kw.get("dropout_p", 0.0)), is_causal=bool(kw.get("is_causal", False)),
        scale=kw.get("scale"), output=output,
        other_outputs_used=others)


def is_math_form(node: fx.Node) -> bool:
    """SDPA's math decomposition (what runs with dropout, or what the fused kernels refuse): marked by its
    `_safe_softmax`, or that op decomposed, any(logical_not(eq(logits, -inf)))). Reported, never rewritten."""
    if _target(node) is aten._safe_softmax.default:
        return True
    if _target(node) is not aten.any.dim:
        return False
    inner = node.args[0]
    if _target(inner) is not aten.logical_not.default:
        return False
    eq = inner.args[0]
    return _target(eq) is aten.eq.Scalar and eq.args[1] == float("-inf")


# ATen's convert_boolean_attn_mask_cudnn (aten/src/ATen/native/transformers/attention.cpp, torch 2.11):
#   at::where(attn_mask->logical_not(), -65504.0, at::scalar_tensor(0.0, dtype))   -- finite, not -inf
CUDNN_MASK_FILL = -65504.0


def _scalar_constant(node, dtype: torch.dtype) -> float | None:
    """The value, in dtype, of a 0-dim constant tensor (scalar_tensor / full([]) of dtype) or number."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        value = node
    elif _target(node) is aten.scalar_tensor.default and node.meta["val"].dtype == dtype:
        value = node.args[0]
    elif _target(node) is aten.full.default and list(node.args[0]) == [] and node.meta["val"].dtype == dtype:
        value = node.args[1]
    else:
        return None
    return float(torch.tensor(value, dtype=dtype)) if isinstance(value, (int, float)) else None


def cudnn_bool_mask(bias) -> fx.Node | None:
    """The bool mask M where bias is ATen's cuDNN conversion of it, else None. Post-grad (dtype = bias's,
    NEG = -65504.0 rounded to dtype: joint-graph constant folding writes full([], -65536.0) for bf16):
        where.self(logical_not(M), NEG, 0)   or   where.self(M, 0, NEG)
    (under expands, which only broadcast: M broadcasts the same way)."""
    return bool_mask_of(bias, CUDNN_MASK_FILL)


def bool_mask_of(bias, fill: float = float("-inf")) -> fx.Node | None:
    """The bool mask M where the additive bias is `where(M, 0, fill)` (or `where(logical_not(M), fill, 0)`)
    with fill rounded to the bias's dtype, under expands; else None. fill -inf: ATen's conversion of a bool
    mask for the CPU flash and efficient forms; CUDNN_MASK_FILL: the cuDNN form's."""
    bias = skip_expands(bias)
    if _target(bias) not in (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar):
        return None
    dtype = bias.meta["val"].dtype
    cond, x, y = bias.args[:3]
    neg = float(torch.tensor(fill, dtype=dtype))
    values = (_scalar_constant(x, dtype), _scalar_constant(y, dtype))
    if _target(cond) is aten.logical_not.default and values == (neg, 0.0):
        cond = cond.args[0]
    elif values != (0.0, neg):
        return None
    if not isinstance(cond, fx.Node) or cond.meta["val"].dtype != torch.bool:
        return None
    return cond


def _target(node) -> object:
    return node.target if isinstance(node, fx.Node) and node.op == "call_function" else None


def _shape(node: fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def skip_noops(node):
    """The node below full-range slices and aliases (post-grad noop removal runs after this pass)."""
    while True:
        t = _target(node)
        if t in (aten.alias.default, aten.detach.default):
            node = node.args[0]
        elif t is aten.slice.Tensor and _shape(node) == _shape(node.args[0]):
            args = [*node.args, *([None] * 5)][:5]
            if args[4] not in (None, 1):
                return node
            node = node.args[0]
        else:
            return node


def skip_expands(node):
    """The node below noops and expands (which only broadcast: what lies below broadcasts the same way)."""
    node = skip_noops(node)
    while _target(node) is aten.expand.default:
        node = skip_noops(node.args[0])
    return node


def unrepeat_kv(node: fx.Node) -> tuple[fx.Node, int]:
    """(base [B, Hkv, L, D], repeats n) where node is head h -> base head h // n; (node, 1) if no repeat.

    Matches repeat_kv / repeat_interleave(n, dim=1) / expand+reshape as they reach the post-grad graph:
        reshape|view|_unsafe_view( [clone]( expand( unsqueeze(base, 2), [B, Hkv, n, L, D] ) ), [B, Hkv*n, L, D])
    """
    node = skip_noops(node)
    if _target(node) not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return node, 1
    src = skip_noops(node.args[0])
    if _target(src) is aten.clone.default:
        src = skip_noops(src.args[0])
    if _target(src) is not aten.expand.default:
        return node, 1
    expanded = src
    src = skip_noops(src.args[0])
    if _target(src) is not aten.unsqueeze.default or src.args[1] not in (2, -3):
        return node, 1
    base = skip_noops(src.args[0])
    b, hkv, length, d = _shape(base)
    n = _shape(expanded)[2]
    if _shape(expanded) != (b, hkv, n, length, d) or _shape(node) != (b, hkv * n, length, d):
        return node, 1
    return base, n
