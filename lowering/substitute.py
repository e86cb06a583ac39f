"""Automatic op substitution: SDPA -> torch.ops.b12x.paged_attention where the result is provably the same.

A post-grad graph rewrite (run by `cache.GRAPH_PASS`, whose uuid includes `cache_state()`), for every
attention call `sdpa_patterns.match` finds:

    out = SDPA(q [B, Hq, S, D], repeat(k) [B, Hq, L, D], repeat(v), mask)      becomes
    out = paged_attention(q.transpose(1, 2), k, v, page_table=arange(B)[:, None], cache_seqlens,
                          kv_layout="HND", causal=..., scale=...)[0].transpose(1, 2)

k [B, Hkv, L, D] read as an HND cache of B pages of L tokens (GQA's repeat_kv copy disappears). Which
cache_seqlens / causal, by case:
- no mask, is_causal=False: every key; cache_seqlens = L, causal=False.
- no mask, is_causal=True and S == L: cache_seqlens = L, causal=True (top-left = bottom-right alignment).
- a mask that `mask_proof.prove_causal` proves is "key j <= position of query i" with consecutive positions
  (the static-cache decode idiom: positions from input_pos / cache_position): cache_seqlens = the last
  query's position + 1, computed on the device and clamped to [0, L], causal=True. The op reads only the
  live keys; what the fixed buffer holds past them never mattered. A proven sliding window on top
  (`key >= position - W`) becomes kv_start = position - W (or window_left=W for constant positions).
  Several queries (S > 1) at runtime positions qualify only where the keys are written at the last
  position (`index_put` into the buffer, as the static-cache idiom does): the op's bottom-right alignment
  equals the mask while that position is < L, which a successful write proves.
The cuDNN form receives a bool mask as ATen's finite conversion `where(~mask, -65504.0, 0)`
(`sdpa_patterns.cudnn_bool_mask`); the bool mask is proven instead, under `_finite_bias`'s conditions.
- a mask no proof places (its values come from a graph input or a buffer, or the proof's conditions fail):
  where it is a bool mask, or its -inf (cuDNN: -65504) additive conversion, and the same for every head,
  the op reads it (`key_mask` [B, S or 1, L], `_read_mask`), causal=False, cache_seqlens / kv_start the
  last + 1 / first key some query of the request sees, reduced from the mask on the device. Exact for any
  mask values; under cuDNN's finite bias a row that sees no key sees every key, as cuDNN computes.
Everything else is left alone, with the reason recorded. Rows that see no key at all (negative positions)
give zeros in the op, as in SDPA's CPU and math paths with a -inf mask.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from b12x_inductor.plan import HEAD_DIMS

from . import _inductor
from .mask_proof import Unprovable, position_forms, prove_causal
from .sdpa_patterns import (CUDNN_MASK_FILL, SdpaCall, bool_mask_of, cudnn_bool_mask, is_math_form, match,
                            skip_expands, skip_noops, unrepeat_kv)

log = logging.getLogger("b12x_inductor.substitute")
aten, prims = torch.ops.aten, torch.ops.prims


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What the pass did with one attention call of a compiled graph."""

    node: str  # the FX node's name
    op: str  # the SDPA form, e.g. "aten._scaled_dot_product_flash_attention_for_cpu.default"
    substituted: bool
    reason: str  # why it was left alone, or what replaced it
    from_cache: bool = False  # the graph came from Inductor's FX graph cache: the decision of its compile

    def __str__(self) -> str:
        cached = " (from Inductor's FX graph cache)" if self.from_cache else ""
        what = "substituted" if self.substituted else "left alone"
        return f"{what}{cached}: {self.node} ({self.op}): {self.reason}"


@dataclass(frozen=True, kw_only=True)
class _Replacement:
    k: fx.Node  # [B, Hkv, L, D]
    v: fx.Node
    causal: bool
    seqlens: tuple  # ("const", n) or ("leaf", node, index, stride, offset)
    summary: str
    window_left: int = -1
    kv_start_shift: int | None = None  # kv_start = clamp(T + 1 - shift, 0, L): a window at a runtime position
    empty_sees_all: bool = False  # cache_seqlens = L where T + 1 <= 0 (cuDNN's finite bias; see _finite_bias)
    key_mask: fx.Node | None = None  # bool [Bm, 1, Sm, Lm] (or fewer leading dims): read by the kernel
    key_mask_fill_empty: bool = False  # a row that sees no key sees every key (cuDNN's finite bias)


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _static(shape) -> tuple[int, ...] | None:
    try:
        return tuple(int(s) for s in shape)
    except TypeError:
        return None


def decide(call: SdpaCall, gm: fx.GraphModule | None = None) -> _Replacement | str:
    """The replacement of one attention call, or the reason to leave it alone."""
    if call.output is None:
        return "its output is unused"
    if call.other_outputs_used:
        return "its logsumexp / RNG outputs are used (a training graph?)"
    if call.dropout_p != 0.0:
        return f"dropout_p={call.dropout_p}: the op has no dropout"
    k, rep_k = unrepeat_kv(call.k)
    v, rep_v = unrepeat_kv(call.v)
    q_val, k_val, v_val = _val(call.q), _val(k), _val(v)
    if q_val is None or k_val is None or v_val is None:
        return "q, k or v has no tensor metadata"
    if rep_k != rep_v:
        return f"k and v repeat their heads differently ({rep_k} and {rep_v})"
    q_shape, k_shape = _static(q_val.shape), _static(k_val.shape)
    if q_shape is None or k_shape is None:
        return "symbolic (dynamic) shapes"
    if len(q_shape) != 4 or len(k_shape) != 4 or tuple(v_val.shape) != k_shape:
        return f"q {q_shape}, k {k_shape}, v {tuple(v_val.shape)}: not [B, H, S, D] with equal k and v"
    (b, hq, s, d), (kb, hkv, length, kd) = q_shape, k_shape
    if kb != b or kd != d:
        return f"q {q_shape} and k {k_shape} differ in batch or head dim"
    if d not in HEAD_DIMS:
        return f"head dim {d}: the op takes " + ", ".join(map(str, HEAD_DIMS))
    if hq % hkv != 0:
        return f"{hq} query heads are not a multiple of {hkv} KV heads"
    device = q_val.device
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if device.type == "cpu" else ())
    if q_val.dtype not in dtypes:
        return f"q is {q_val.dtype} on {device.type}: the op takes " + ", ".join(map(str, dtypes)) + " there"
    if k_val.dtype != q_val.dtype or v_val.dtype != q_val.dtype:
        return f"k / v dtype ({k_val.dtype}, {v_val.dtype}) differs from q's ({q_val.dtype})"
    if any(t.device != device for t in (k_val, v_val)):
        return "q, k and v are on different devices"
    if q_val.stride(-1) != 1 or k_val.stride(-1) != 1 or v_val.stride(-1) != 1:
        return "q, k or v is not contiguous in its head dim"
    geometry = f"B={b} Hq={hq} Hkv={hkv} S={s} L={length} D={d}"
    if call.mask is None:
        if call.is_causal and s != length:
            return (f"is_causal with S={s} != L={length}: SDPA aligns the causal mask top-left, the op "
                    f"bottom-right")
        return _Replacement(k=k, v=v, causal=call.is_causal, seqlens=("const", length),
                            summary=f"{geometry}, causal={call.is_causal}, cache_seqlens = L")
    if call.is_causal:
        return "both a mask and is_causal"
    if not isinstance(call.mask, fx.Node):
        return "the mask is not a tensor of the graph"
    proven = _proven(call, k, v, geometry, gm, b, hq, s, length)
    if not isinstance(proven, str):
        return proven
    read = _read_mask(call, k, v, geometry, b, s, length)
    if isinstance(read, str):
        return f"{proven}; {read}"
    return dataclasses.replace(read, summary=f"{read.summary} ({proven})")


def _read_mask(call: SdpaCall, k, v, geometry: str, b: int, s: int, length: int) -> _Replacement | str:
    """The replacement that hands the kernel the mask itself (op argument key_mask), or why not: exact for
    any bool mask (and its -inf / cuDNN -65504 additive conversions) that is the same for every head.
    cache_seqlens and kv_start become the last and first keys some row of the request sees (computed on the
    device), causal=False: the mask alone decides within that range. Rows that see no key give zeros, as
    SDPA's CPU and math paths do with a -inf mask; under cuDNN's finite bias such a row sees every key."""
    val = _val(call.mask)
    cudnn = call.node.target is aten._scaled_dot_product_cudnn_attention.default
    if val is not None and val.dtype == torch.bool:
        mask = call.mask
    else:
        mask = cudnn_bool_mask(call.mask) if cudnn else bool_mask_of(call.mask)
        if mask is None:
            return ("an additive mask that is not a bool mask's 0 / -inf form: its values are unknown at "
                    "compile time")
    base = skip_expands(mask)
    shape = _static(_val(base).shape) if _val(base) is not None else None
    if shape is None or len(shape) > 4:
        return f"the mask's shape {shape} is not static or has more than 4 dims"
    bm, hm, sm, lm = (1,) * (4 - len(shape)) + shape
    if hm != 1:
        return f"the mask differs per head ({hm} heads): the op takes one mask row per query"
    if bm not in (1, b) or sm not in (1, s) or lm not in (1, length):
        return f"mask shape {shape} does not broadcast to [B={b}, 1, S={s}, L={length}]"
    form = "cuDNN's bool-mask bias" if cudnn and mask is not call.mask else "the mask"
    return _Replacement(k=k, v=v, causal=False, seqlens=("mask",), key_mask=base,
                        key_mask_fill_empty=cudnn and mask is not call.mask,
                        summary=f"{geometry}, {form} read by the kernel (key_mask [B, {sm}, {length}]), "
                                f"cache_seqlens / kv_start = the last / first key some row sees")


def _proven(call: SdpaCall, k, v, geometry: str, gm, b: int, hq: int, s: int, length: int) -> _Replacement | str:
    """The replacement from a compile-time proof of the mask's meaning (no mask read), or why not."""
    bool_mask = cudnn_bool_mask(call.mask) \
        if call.node.target is aten._scaled_dot_product_cudnn_attention.default else None
    finite = bool_mask is not None
    mask = bool_mask if finite else call.mask
    try:
        proof = prove_causal(mask, batch=b, heads=hq, q_len=s, kv_len=length, graph_module=gm)
    except Unprovable as e:
        return f"mask not proven causal: {e}"
    except Exception as e:  # anything unexpected in the analysis: leave the call alone
        return f"mask analysis failed ({type(e).__name__}: {e})"
    if not proof.causal:
        return _Replacement(k=k, v=v, causal=False, seqlens=("const", length),
                            summary=f"{geometry}, the mask hides nothing, cache_seqlens = L")
    if finite:
        refused = _finite_bias(proof, s)
        if refused:
            return refused
        geometry += f", cuDNN's bool-mask bias ({CUDNN_MASK_FILL}) proven causal"
    window = f", window_left={proof.window_left}" if proof.window_left >= 0 else ""
    if proof.leaf is None:
        n = min(max(proof.offset, 0), length)
        if n < s or (proof.offset > length and (s > 1 or proof.window_left >= 0)):
            return f"constant positions past the keys or before the queries (last position + 1 = {proof.offset})"
        return _Replacement(k=k, v=v, causal=True, seqlens=("const", n), window_left=proof.window_left,
                            summary=f"{geometry}, causal mask with constant positions{window}, cache_seqlens = {n}")
    written = _written_last_position(k, proof, b, gm)
    if s > 1 and not written:  # row i sees keys <= T_i; the op's L_b - S + i equals T_i only while T_{S-1} < L
        return (f"{s} queries at runtime positions: exact only while the last position is < L={length}, which "
                f"the pass cannot prove (no write of the keys at that position)")
    where = f"{proof.leaf.name}.flatten()[{proof.index} + {proof.stride} * b] + {proof.offset}"
    summary = f"{geometry}, causal up to a position, cache_seqlens = clamp({where}, 0, {length})"
    if written:
        summary += " (the keys are written there, so it is < L)"
    if proof.window_left >= 0 and written:
        summary += window
        return _Replacement(k=k, v=v, causal=True, window_left=proof.window_left, summary=summary,
                            seqlens=("leaf", proof.leaf, proof.index, proof.stride, proof.offset))
    if proof.window_left >= 0:  # as kv_start, exact also where the position is past the keys
        summary += f", kv_start = clamp({where} - {proof.window_left + 1}, 0, {length})"
    if finite:
        summary += " (L where that is <= 0: no key visible, the finite bias shifts every logit alike)"
    return _Replacement(k=k, v=v, causal=True, kv_start_shift=proof.window_left + 1 if window else None,
                        seqlens=("leaf", proof.leaf, proof.index, proof.stride, proof.offset), summary=summary,
                        empty_sees_all=finite)


def _finite_bias(proof, s: int) -> str | None:
    """Why a proven mask converted for cuDNN (hidden keys get -65504, not -inf) is refused, or None.

    A row that sees some key: the hidden logits sit 65504 - (spread of the scaled logits) below its
    maximum, so for any spread under ~65000 their exp underflows to exactly 0 in fp32, as with -inf.
    A row that sees no key: every logit moves by the same constant and the softmax is over all keys (not
    zeros). Constant positions: every row must see a key. Runtime positions: one query without a window,
    whose row sees no key exactly where T + 1 <= 0, there given cache_seqlens = L (every key, as cuDNN
    computes); anything else is refused."""
    if not proof.causal:
        return None
    if proof.leaf is None:
        if proof.offset < s:
            return (f"cuDNN's bool-mask bias is finite ({CUDNN_MASK_FILL}): a query row sees no key (last "
                    f"position + 1 = {proof.offset} < {s} queries), where it would attend to every key")
        return None
    if s > 1 or proof.window_left >= 0:
        return (f"cuDNN's bool-mask bias is finite ({CUDNN_MASK_FILL}): with runtime positions and "
                f"{'a window' if proof.window_left >= 0 else f'{s} queries'}, the pass cannot prove every query "
                f"row sees some key")
    return None


def _written_last_position(k: fx.Node, proof, batch: int, gm) -> bool:
    """Whether k (without its repeat) is the static-cache write `index_put(buffer, [None, None, positions],
    new_keys)` with each request's last query position among the positions: a write that succeeded (out of
    range it fails, on the device too: Inductor asserts indirect indices) proves it is < L."""
    node = skip_noops(k)
    if node.op != "call_function" or node.target is not aten.index_put.default:
        return False
    indices = list(node.args[1])
    if len(indices) < 3 or indices[:2] != [None, None] or any(i is not None for i in indices[3:]) \
            or not isinstance(indices[2], fx.Node):
        return False
    forms = position_forms(indices[2], gm)
    last = proof.offset - 1
    return all((proof.leaf, proof.index + proof.stride * i, last) in forms for i in range(batch))


class _Builder:
    """Inserts nodes before `anchor`, each with its fake "val"; can take them all back."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_mode):
        self.graph, self.anchor, self.mode, self.added = graph, anchor, fake_mode, []

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        self.added.append(node)
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def undo(self) -> None:
        for node in reversed(self.added):
            self.graph.erase_node(node)


def _lengths(add: _Builder, rep: _Replacement, batch: int, length: int, device) -> tuple[fx.Node, fx.Node | None]:
    """(cache_seqlens, kv_start or None), int32 [B] on the device."""
    if rep.seqlens[0] == "const":
        full = add(aten.full.default, [batch], rep.seqlens[1], dtype=torch.int32, device=device, pin_memory=False)
        return full, None
    _, leaf, index, stride, offset = rep.seqlens
    flat = add(aten.reshape.default, leaf, [-1])
    if stride == 0 or batch == 1:
        pos = add(aten.expand.default, add(aten.select.int, flat, 0, index), [batch])
    else:
        pos = add(aten.slice.Tensor, flat, 0, index, index + stride * (batch - 1) + 1, stride)

    def clamped(shift: int, empty_sees_all: bool = False) -> fx.Node:  # clamp(pos + shift, 0, L), int32
        x = add(aten.clamp_max.default, add(aten.clamp_min.default, add(aten.add.Tensor, pos, shift), 0), length)
        if empty_sees_all:  # x + L * (x <= 0): L where pos + shift <= 0
            empty = add(prims.convert_element_type.default, add(aten.le.Scalar, x, 0), x.meta["val"].dtype)
            x = add(aten.add.Tensor, x, add(aten.mul.Tensor, empty, length))
        return add(aten.clone.default, add(prims.convert_element_type.default, x, torch.int32),
                   memory_format=torch.contiguous_format)

    kv_start = None if rep.kv_start_shift is None else clamped(offset - rep.kv_start_shift)
    return clamped(offset, rep.empty_sees_all), kv_start


def _mask_nodes(add: _Builder, rep: _Replacement, batch: int, length: int, device):
    """(key_mask bool [B, Sm, L], cache_seqlens, kv_start int32 [B]) of a read mask."""
    m = rep.key_mask
    while m.meta["val"].dim() < 4:
        m = add(aten.unsqueeze.default, m, 0)
    m = add(aten.select.int, m, 1, 0)  # [Bm, Sm, Lm]
    bm, sm, lm = m.meta["val"].shape
    if lm != length:
        m = add(aten.expand.default, m, [bm, sm, length])
    # (only ops Inductor lowers after its decompositions: amax of int32 for `any`, mul and add for `L - x`)
    as_int = add(prims.convert_element_type.default, m, torch.int32)
    if rep.key_mask_fill_empty:  # a row that sees no key sees them all
        row_seen = add(aten.amax.default, as_int, [-1], True)
        m = add(aten.logical_or.default, m, add(aten.eq.Scalar, row_seen, 0))
        as_int = add(prims.convert_element_type.default, m, torch.int32)
    seen = add(aten.amax.default, as_int, [1])  # [Bm, L]: 1 where some row sees the key
    pos = add(prims.iota.default, length, start=0, step=1, dtype=torch.int32, device=device, requires_grad=False)
    last = add(aten.amax.default, add(aten.mul.Tensor, seen, add(aten.add.Tensor, pos, 1)), [-1])  # 0: none
    # first = L - max(seen * (L - pos)): L where none
    first = add(aten.add.Tensor, add(aten.mul.Tensor, add(aten.amax.default, add(
        aten.mul.Tensor, seen, add(aten.add.Tensor, add(aten.mul.Tensor, pos, -1), length)), [-1]), -1), length)

    def lengths(x: fx.Node) -> fx.Node:
        x = add(prims.convert_element_type.default, x, torch.int32)
        if bm != batch:
            x = add(aten.expand.default, x, [batch])
        return add(aten.clone.default, x, memory_format=torch.contiguous_format)

    key_mask = m if bm == batch else add(aten.expand.default, m, [batch, sm, length])
    return key_mask, lengths(last), lengths(add(aten.minimum.default, first, last))


def _apply(call: SdpaCall, rep: _Replacement) -> None:
    graph = call.node.graph
    q_val, k_val = _val(call.q), _val(rep.k)
    batch, length, device = int(k_val.shape[0]), int(k_val.shape[2]), q_val.device
    add = _Builder(graph, call.node, _inductor.fake_mode_of([q_val, k_val]))
    try:
        q = add(aten.permute.default, call.q, [0, 2, 1, 3])  # [B, S, Hq, D]
        iota = add(prims.iota.default, batch, start=0, step=1, dtype=torch.int32, device=device, requires_grad=False)
        pages = add(aten.unsqueeze.default, iota, 1)
        key_mask = None
        if rep.key_mask is not None:
            key_mask, seqlens, kv_start = _mask_nodes(add, rep, batch, length, device)
        else:
            seqlens, kv_start = _lengths(add, rep, batch, length, device)
        pair = add(torch.ops.b12x.paged_attention.default, q, rep.k, rep.v, pages, seqlens, None,
                   kv_layout="HND", causal=rep.causal, scale=call.scale, window_left=rep.window_left,
                   kv_start=kv_start, key_mask=key_mask)
        out = add(aten.permute.default, add(operator.getitem, pair, 0), [0, 2, 1, 3])  # [B, Hq, S, D]
    except Exception:
        add.undo()
        raise
    old_inputs = [n for n in (call.k, call.v, call.mask) if isinstance(n, fx.Node)]
    call.output.replace_all_uses_with(out)
    for user in list(call.node.users):
        graph.erase_node(user)
    if call.output is not call.node:
        graph.erase_node(call.node)
    _erase_dead(graph, old_inputs)


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erases the now unused, side-effect-free producers of the old inputs (the repeat_kv copies)."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.users or node.op != "call_function" or node.graph is not graph:
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None or schema.is_mutable or node.target.namespace not in ("aten", "prims"):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        stack.extend(inputs)


def _form(node: fx.Node) -> str:
    return f"{node.target.namespace}.{node.target.__name__}"


def rewrite_graph(gm_or_graph) -> list[Decision]:
    """Substitutes every provable attention call of the graph; returns one Decision per call."""
    graph = gm_or_graph.graph if isinstance(gm_or_graph, fx.GraphModule) else gm_or_graph
    gm = gm_or_graph if isinstance(gm_or_graph, fx.GraphModule) else graph.owning_module
    decisions = []
    for node in list(graph.nodes):
        if is_math_form(node):
            decisions.append(Decision(node=node.name, op="math decomposition", substituted=False,
                                      reason="SDPA's math form (dropout, or what the fused kernels refuse) is "
                                             "not matched"))
        name = node.name
        try:
            call = match(node)
        except Exception as e:
            decisions.append(Decision(node=name, op=str(node.target), substituted=False,
                                      reason=f"its arguments could not be read ({type(e).__name__}: {e})"))
            continue
        if call is None:
            continue
        form = _form(node)
        try:
            rep = decide(call, gm)
        except Exception as e:
            rep = f"analysis failed ({type(e).__name__}: {e})"
        if isinstance(rep, str):
            decisions.append(Decision(node=name, op=form, substituted=False, reason=rep))
            continue
        try:
            _apply(call, rep)
        except Exception as e:  # the op's own checks (its fake) refused the call
            decisions.append(Decision(node=name, op=form, substituted=False,
                                      reason=f"the op refused it: {type(e).__name__}: {e}"))
            continue
        decisions.append(Decision(node=name, op=form, substituted=True, reason=rep.summary))
    if any(d.substituted for d in decisions):
        graph.lint()
    return decisions


class SdpaSubstitution:
    """The rewrite registered in `cache.GRAPH_PASS.rewrites`; off until enabled."""

    def __init__(self) -> None:
        self.enabled = False
        self.last: tuple[Decision, ...] = ()

    def cache_state(self) -> str:
        return f"sdpa-substitution-{'on' if self.enabled else 'off'}"

    def __call__(self, graph) -> None:
        if not self.enabled:
            return
        decisions = rewrite_graph(graph)
        if decisions:
            self.last = tuple(decisions)
            _record(decisions)
        for d in decisions:
            log.info("%s", d)

    def replayed(self, decisions: tuple[Decision, ...]) -> None:
        """The decisions of a graph that Inductor loaded from its FX graph cache (the pass did not run)."""
        self.last = decisions
        for d in decisions:
            log.info("%s", d)


REWRITE = SdpaSubstitution()


# Decisions survive Inductor's FX graph cache: the pass counts one `_Record` (a str) into the cache entry
# (`_inductor.count_in_cache_entry`); a process that loads the entry unpickles it, and unpickling a _Record
# calls `_replay`, which hands its decisions to `REWRITE.replayed`.

class _Record(str):
    def __reduce__(self):
        return _replay, (str(self),)


def _record(decisions) -> None:
    payload = [dataclasses.asdict(d) for d in decisions]
    _inductor.count_in_cache_entry(_Record("b12x substitution decisions " + json.dumps(payload)))


def _replay(key: str) -> _Record:
    try:
        payload = json.loads(key.split(" ", 3)[3])
        REWRITE.replayed(tuple(Decision(**dict(d, from_cache=True)) for d in payload))
    except Exception as e:  # a record of another version: report nothing rather than fail the load
        log.info("b12x substitution: cached decisions not read (%s: %s)", type(e).__name__, e)
    return _Record(key)
