"""Proves, at compile time, that an attention mask means "key j visible iff j <= position of the query".

The mask's FX subgraph is evaluated abstractly: every integer tensor the pass cannot compute (a graph
input such as `input_pos`, a cache position) becomes a vector of free integer variables v, and

- an integer tensor is, element by element, an affine form  c0 + c . v      (_Int: [*shape, n + 1])
- a bool tensor is a conjunction of conditions  form_k >= 0                 (_Bool: [*shape, K, n + 1])
- a float tensor is `a where condition else b` for constants a, b           (_Float)

Shape ops act on the leading (logical) dims. A proof holds for every value of the variables, so it is a
proof, not a test. Anything the evaluator does not model (a bool or float tensor read from a buffer,
`==` on positions, OR of two position conditions) raises `Unprovable` with the reason, and the caller
leaves the graph alone. `prove_causal` then checks that the mask, broadcast to [B, H, S, L], is exactly
`j <= T[b, i]` with T[b, i] = T[b, S-1] - (S-1-i) (consecutive query positions) and T[b, S-1] one
position variable + a constant: the paged op with causal=True and cache_seqlens[b] = T[b, S-1] + 1.
A second condition `j >= T[b, i] - W` (a sliding window, W constant) becomes window_left=W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

MAX_VARS = 4096
MAX_ELEMENTS = 1 << 24  # elements x (variables + 1) of one tensor the proof may build (expand is a view)
# Only -inf hides a key in every case: a finite minimum (torch.finfo(dtype).min) hides it too while the row
# sees some key, but a row that sees none then averages all values instead of giving zeros.
HIDDEN = float("-inf")


class Unprovable(Exception):
    """The mask's meaning cannot be established at compile time; the message says why."""


@dataclass(frozen=True, kw_only=True)
class CausalMask:
    """What a proven mask means: cache_seqlens[b] = leaf.flatten()[index + stride * b] + offset (leaf
    None: offset alone), causal=True with window_left (-1: none); or causal=False, every key visible."""

    causal: bool
    leaf: fx.Node | None = None
    index: int = 0
    stride: int = 0
    offset: int = 0
    window_left: int = -1


@dataclass
class _Int:
    c: torch.Tensor  # int64 [*shape, n + 1]: const, coefficients


@dataclass
class _Bool:
    p: torch.Tensor  # int64 [*shape, K, n + 1]: AND over k of (p[..., k, :] . [1, v] >= 0)


@dataclass
class _Float:
    p: torch.Tensor  # as _Bool
    a: torch.Tensor  # float64 [*shape], the value where the condition holds
    b: torch.Tensor  # float64 [*shape], elsewhere


_EXTRA = {_Int: (1,), _Bool: (2,), _Float: (2, 0, 0)}


def _parts(x):
    return (x.c,) if isinstance(x, _Int) else (x.p,) if isinstance(x, _Bool) else (x.p, x.a, x.b)


def _shape(x) -> tuple[int, ...]:
    t, extra = _parts(x)[0], _EXTRA[type(x)][0]
    return tuple(t.shape[: t.dim() - extra])


def _map(x, fn):
    """Applies fn(tensor, trailing_dims) to every part of x, keeping its kind."""
    return type(x)(*(fn(t, e) for t, e in zip(_parts(x), _EXTRA[type(x)])))


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _broadcast(*xs):
    shape = torch.broadcast_shapes(*(_shape(x) for x in xs))
    return [_map(x, lambda t, e: t.expand(*shape, *t.shape[t.dim() - e:])) for x in xs]


class _Evaluator:
    def __init__(self, graph_module: fx.GraphModule | None, n: int, leaves: dict[fx.Node, int]):
        self.gm, self.n, self.leaves, self.memo = graph_module, n, leaves, {}

    # constants
    def const(self, t: torch.Tensor):
        if t.dtype == torch.bool:
            p = torch.zeros(*t.shape, 1, self.n + 1, dtype=torch.long)
            p[..., 0, 0] = torch.where(t, 0, -1)
            return _Bool(p)
        if t.is_floating_point():
            return _Float(torch.zeros(*t.shape, 0, self.n + 1, dtype=torch.long), t.double(), t.double())
        if t.is_complex():
            raise Unprovable(f"complex tensor in the mask ({t.dtype})")
        c = torch.zeros(*t.shape, self.n + 1, dtype=torch.long)
        c[..., 0] = t.long()
        return _Int(c)

    def value(self, a):
        if isinstance(a, fx.Node):
            if a not in self.memo:
                self.memo[a] = self.node(a)
            return self.memo[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self.value(x) for x in a)
        return a

    def node(self, node: fx.Node):
        if node in self.leaves:
            shape = _static_shape(node)
            first, count = self.leaves[node], _numel(shape)
            c = torch.zeros(count, self.n + 1, dtype=torch.long)
            c[torch.arange(count), 1 + first + torch.arange(count)] = 1
            return _Int(c.reshape(*shape, self.n + 1))
        if node.op == "get_attr":
            return self.const(_get_attr(self.gm, node.target).detach().cpu())
        name = _op_name(node)
        if name != "aten.expand" and _numel(_static_shape(node)) * (self.n + 1) > MAX_ELEMENTS:
            raise Unprovable(f"{node.name} is too large to analyze ({tuple(_static_shape(node))})")
        rule = _RULES.get(name)
        args = [self.value(a) for a in node.args]
        kwargs = {k: self.value(v) for k, v in node.kwargs.items()}
        return rule(self, node, *args, **kwargs)


def _op_name(node: fx.Node) -> str | None:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return f"{node.target.namespace}.{node.target.overloadpacket.__name__}"


def _get_attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _val(node: fx.Node):
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise Unprovable(f"{node.name} has no tensor metadata")
    return val


def _static_shape(node: fx.Node) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in _val(node).shape)
    except TypeError as e:  # a SymInt that is not a constant
        raise Unprovable(f"{node.name} has a symbolic shape {tuple(_val(node).shape)}") from e


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


# ---- rules: (evaluator, node, *abstract args, **abstract kwargs) -> abstract value ----

def _created(ev, node, *args, **kwargs):
    """A tensor whose value the pass computes for real (iota, arange, full, ...), from node's metadata."""
    val = _val(node)
    shape = _static_shape(node)
    if _numel(shape) * (ev.n + 1) > MAX_ELEMENTS:
        raise Unprovable(f"{node.name} is too large to analyze")
    name = _op_name(node)
    if name in ("prims.iota", "aten.arange"):
        real = node.target(*args, **{**kwargs, "device": "cpu"})
    elif name in ("aten.full", "aten.scalar_tensor", "aten.full_like"):
        fill = args[1] if name != "aten.scalar_tensor" else args[0]
        if not isinstance(fill, (int, float, bool)):
            raise Unprovable(f"{node.name} fills with a non-constant value")
        real = torch.full(shape, fill, dtype=val.dtype)
    else:  # zeros, ones and their _like forms
        real = torch.full(shape, 1 if "ones" in name else 0, dtype=val.dtype)
    return ev.const(real)


def _view(ev, node, x, *args, **kwargs):
    shape = _static_shape(node)
    return _map(x, lambda t, e: t.reshape(*shape, *t.shape[t.dim() - e:]))


def _expand(ev, node, x, *args, **kwargs):
    shape = _static_shape(node)
    return _map(x, lambda t, e: t.expand(*shape, *t.shape[t.dim() - e:]))


def _identity(ev, node, x, *args, **kwargs):
    return x


def _unsqueeze(ev, node, x, d):
    d = _dim(d, len(_shape(x)) + 1)
    return _map(x, lambda t, e: t.unsqueeze(d))


def _squeeze(ev, node, x, dims=None):
    rank = len(_shape(x))
    dims = range(rank) if dims is None else [dims] if isinstance(dims, int) else dims
    keep = [i for i, s in enumerate(_shape(x)) if not (s == 1 and i in {_dim(d, rank) for d in dims})]
    return _view(ev, node, x) if len(keep) < rank else x


def _permute(ev, node, x, dims):
    rank = len(_shape(x))
    dims = [_dim(d, rank) for d in dims]
    return _map(x, lambda t, e: t.permute(*dims, *range(rank, t.dim())))


def _transpose(ev, node, x, a, b):
    rank = len(_shape(x))
    return _map(x, lambda t, e: t.transpose(_dim(a, rank), _dim(b, rank)))


def _slice(ev, node, x, dim=0, start=None, end=None, step=1):
    d = _dim(dim, len(_shape(x)))
    return _map(x, lambda t, e: t[(slice(None),) * d + (slice(start, end, step),)])


def _select(ev, node, x, dim, index):
    d = _dim(dim, len(_shape(x)))
    return _map(x, lambda t, e: t.select(d, index))


def _constant_ints(x, what: str) -> torch.Tensor:
    if not isinstance(x, _Int) or bool(x.c[..., 1:].any()):
        raise Unprovable(f"{what} depends on runtime values")
    return x.c[..., 0]


def _index(ev, node, x, indices):
    idx = tuple(slice(None) if i is None else _constant_ints(i, f"an index of {node.name}") for i in indices)
    return _map(x, lambda t, e: t[idx])


def _pad(ev, node, x, pad, value=0.0):
    if any(p < 0 for p in pad):
        raise Unprovable(f"{node.name} crops with a negative pad")
    rank = len(_shape(x))
    out_shape = _static_shape(node)
    where = tuple(slice(pad[2 * (rank - 1 - d)], pad[2 * (rank - 1 - d)] + s) if 2 * (rank - 1 - d) < len(pad)
                  else slice(None) for d, s in enumerate(_shape(x)))

    if isinstance(x, _Bool):
        raise Unprovable(f"{node.name} pads a bool mask")

    def fn(t, e):
        new = t.new_zeros(*out_shape, *t.shape[t.dim() - e:])
        if e == 0:
            new.fill_(value)
        elif isinstance(x, _Int):
            new[..., 0] = int(value)
        new[where] = t
        return new

    return _map(x, fn)


def _convert(ev, node, x, *args, **kwargs):
    dtype = _val(node).dtype
    if isinstance(x, _Int) and dtype in (torch.int64, torch.int32):  # positions stay far below 2**31
        return x
    if isinstance(x, _Bool) and dtype == torch.bool:
        return x
    if isinstance(x, _Bool) and dtype.is_floating_point:
        one = torch.ones(_shape(x), dtype=torch.float64)
        return _Float(x.p, one, torch.zeros_like(one))
    if isinstance(x, _Float) and dtype.is_floating_point:
        return _Float(x.p, x.a.to(dtype).double(), x.b.to(dtype).double())
    raise Unprovable(f"{node.name} converts the mask to {dtype}")


def _as_int(ev, x, what):
    if isinstance(x, _Int):
        return x
    if isinstance(x, bool) or not isinstance(x, int):
        raise Unprovable(f"{what} is not integer arithmetic")
    return ev.const(torch.tensor(x))


def _is_const_float(x) -> bool:
    return isinstance(x, _Float) and x.p.shape[-2] == 0


def _arith(sign):
    def rule(ev, node, x, y, alpha=1):
        if isinstance(x, _Float) or isinstance(y, _Float):
            if isinstance(y, (int, float)) and not isinstance(y, bool):
                return _Float(x.p, x.a + sign * alpha * y, x.b + sign * alpha * y)
            x, y = _broadcast(x, y)
            if _is_const_float(y):
                return _Float(x.p, x.a + sign * alpha * y.a, x.b + sign * alpha * y.a)
            if _is_const_float(x) and sign == 1:
                return _Float(y.p, y.a + x.a, y.b + x.a)
            raise Unprovable(f"{node.name} adds two masks")
        x, y = _broadcast(_as_int(ev, x, node.name), _as_int(ev, y, node.name))
        return _Int(x.c + sign * alpha * y.c)

    return rule


def _mul(ev, node, x, y):
    if isinstance(x, _Bool) and isinstance(y, _Bool):
        return _and(ev, node, x, y)
    if isinstance(x, _Float) and isinstance(y, (int, float)) and not isinstance(y, bool):
        return _Float(x.p, x.a * y, x.b * y)
    x, y = _broadcast(_as_int(ev, x, node.name), _as_int(ev, y, node.name))
    if bool(y.c[..., 1:].any()):
        x, y = y, x
    if bool(y.c[..., 1:].any()):
        raise Unprovable(f"{node.name} multiplies two positions")
    return _Int(x.c * y.c[..., :1])


def _neg(ev, node, x):
    return _Int(-_as_int(ev, x, node.name).c)


def _compare(flip: bool, strict: bool):
    """a <= b (a < b with strict); flip swaps a and b (>=, >). The condition is form >= 0."""

    def rule(ev, node, a, b):
        a, b = _broadcast(_as_int(ev, a, node.name), _as_int(ev, b, node.name))
        if flip:
            a, b = b, a
        form = b.c - a.c
        form[..., 0] -= int(strict)
        return _Bool(form.unsqueeze(-2))

    return rule


def _equal(negate: bool):
    def rule(ev, node, a, b):
        a, b = _broadcast(_as_int(ev, a, node.name), _as_int(ev, b, node.name))
        eq = _constant_ints(a, f"{node.name} (==/!=)") == _constant_ints(b, f"{node.name} (==/!=)")
        return ev.const(eq != negate)

    return rule


def _truth(p: torch.Tensor) -> torch.Tensor | None:
    """Per element truth of a var-free conjunction; None if some condition has variables."""
    if bool(p[..., 1:].any()):
        return None
    return (p[..., 0] >= 0).all(-1)


def _compact(x: _Bool) -> _Bool:
    """Drops conditions that hold for every element whatever the variables."""
    p = x.p
    flat = p.reshape(-1, *p.shape[-2:])  # [elements, K, n + 1]
    true_slot = ~flat[..., 1:].any(0).any(-1) & (flat[..., 0] >= 0).all(0)
    return _Bool(p[..., ~true_slot, :]) if bool(true_slot.any()) else x


def _and(ev, node, x, y):
    if not (isinstance(x, _Bool) and isinstance(y, _Bool)):
        raise Unprovable(f"{node.name} is not a logical and of two conditions")
    x, y = _broadcast(x, y)
    return _compact(_Bool(torch.cat([x.p, y.p], dim=-2)))


def _or(ev, node, x, y):
    if not (isinstance(x, _Bool) and isinstance(y, _Bool)):
        raise Unprovable(f"{node.name} is not a logical or of two conditions")
    x, y = _broadcast(x, y)
    for const, other in ((x, y), (y, x)):
        truth = _truth(const.p)
        if truth is not None:  # true where const holds, else the other side
            return _Bool(other.p * (~truth)[..., None, None])
    raise Unprovable(f"{node.name} is an OR of two position conditions")


def _negate(x: _Bool, name: str) -> _Bool:
    x = _compact(x)
    k = x.p.shape[-2]
    if k == 0:
        p = torch.zeros(*x.p.shape[:-2], 1, x.p.shape[-1], dtype=torch.long)
        p[..., 0] = -1
        return _Bool(p)
    if k > 1:
        raise Unprovable(f"{name} negates a conjunction of position conditions")
    p = -x.p
    p[..., 0] -= 1  # not (f >= 0)  <=>  -f - 1 >= 0
    return _Bool(p)


def _not(ev, node, x):
    if not isinstance(x, _Bool):
        raise Unprovable(f"{node.name} negates a non-bool tensor")
    return _negate(x, node.name)


def _where(ev, node, cond, x, y):
    if not isinstance(cond, _Bool):
        raise Unprovable(f"{node.name} selects by a non-bool condition")
    if isinstance(x, (int, float)):
        x = ev.const(torch.tensor(float(x)))
    if isinstance(y, (int, float)):
        y = ev.const(torch.tensor(float(y)))
    if isinstance(x, _Bool) and isinstance(y, _Bool):
        tx, ty = _truth(x.p), _truth(y.p)
        if tx is not None and ty is not None and bool((tx == tx.flatten()[0]).all() & (ty == ty.flatten()[0]).all()):
            tx, ty = bool(tx.flatten()[0]), bool(ty.flatten()[0])
            if tx == ty:
                return x
            return cond if tx else _negate(cond, node.name)
        raise Unprovable(f"{node.name} selects between two conditions")
    if not (_is_const_float(x) and _is_const_float(y)):
        raise Unprovable(f"{node.name} selects between non-constant values")
    cond, x, y = _broadcast(cond, x, y)
    return _Float(cond.p, x.a, y.a)


def _tri(lower: bool):
    def rule(ev, node, x, diagonal=0):
        if not isinstance(x, _Bool) or len(_shape(x)) < 2:
            raise Unprovable(f"{node.name} is a tril/triu of a non-bool tensor")
        rows, cols = _shape(x)[-2:]
        keep = torch.ones(rows, cols, dtype=torch.bool)
        keep = keep.tril(diagonal) if lower else keep.triu(diagonal)
        return _and(ev, node, x, ev.const(keep))

    return rule


def _masked_fill(ev, node, x, mask, value):
    return _where(ev, node, mask, value, x)


_RULES = {
    **dict.fromkeys(["prims.iota", "aten.arange", "aten.full", "aten.scalar_tensor", "aten.full_like",
                     "aten.zeros", "aten.ones", "aten.zeros_like", "aten.ones_like"], _created),
    **dict.fromkeys(["aten.view", "aten.reshape", "aten._unsafe_view", "aten.squeeze_copy"], _view),
    **dict.fromkeys(["aten.clone", "aten.alias", "aten.contiguous", "aten.lift_fresh_copy", "aten.detach"],
                    _identity),
    "aten.expand": _expand, "aten.unsqueeze": _unsqueeze, "aten.squeeze": _squeeze, "aten.permute": _permute,
    "aten.transpose": _transpose, "aten.slice": _slice, "aten.select": _select, "aten.index": _index,
    "aten.constant_pad_nd": _pad,
    **dict.fromkeys(["prims.convert_element_type", "aten._to_copy", "aten.to"], _convert),
    "aten.add": _arith(1), "aten.sub": _arith(-1), "aten.mul": _mul, "aten.neg": _neg,
    "aten.le": _compare(False, False), "aten.lt": _compare(False, True),
    "aten.ge": _compare(True, False), "aten.gt": _compare(True, True),
    "aten.eq": _equal(False), "aten.ne": _equal(True),
    **dict.fromkeys(["aten.logical_and", "aten.bitwise_and", "aten.__and__"], _and),
    **dict.fromkeys(["aten.logical_or", "aten.bitwise_or", "aten.__or__"], _or),
    **dict.fromkeys(["aten.logical_not", "aten.bitwise_not"], _not),
    "aten.where": _where, "aten.masked_fill": _masked_fill, "aten.tril": _tri(True), "aten.triu": _tri(False),
}


def _collect_leaves(mask: fx.Node) -> dict[fx.Node, int]:
    """Integer tensors the evaluator treats as free variables -> index of their first variable."""
    leaves, seen, stack, n = {}, set(), [mask], 0
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr":
            continue
        if _op_name(node) in _RULES:
            stack.extend(node.all_input_nodes)
            continue
        val = _val(node)
        if val.dtype.is_floating_point or val.dtype.is_complex or val.dtype == torch.bool:
            kind = "a graph input" if node.op == "placeholder" else f"the result of {node.target}"
            raise Unprovable(f"the mask reads {node.name} ({kind}, {val.dtype}), whose values are unknown at "
                             f"compile time")
        leaves[node] = n
        n += _numel(_static_shape(node))
        if n > MAX_VARS:
            raise Unprovable(f"the mask depends on more than {MAX_VARS} runtime integers")
    return leaves


def evaluate(mask: fx.Node, graph_module: fx.GraphModule | None = None):
    """The abstract value of mask's subgraph (and its leaves: node -> first variable index)."""
    leaves = _collect_leaves(mask)
    n = sum(_numel(_static_shape(node)) for node in leaves)
    ev = _Evaluator(graph_module, n, leaves)
    return ev.value(mask), leaves


def _as_bool(x) -> _Bool:
    """A bool mask, or an additive float mask whose values are only 0 (visible) and hidden (-inf)."""
    if isinstance(x, _Bool):
        return x
    if not isinstance(x, _Float):
        raise Unprovable("the mask is an integer tensor")
    vis_a, vis_b, hid_a, hid_b = x.a == 0, x.b == 0, x.a <= HIDDEN, x.b <= HIDDEN
    if x.p.shape[-2] == 0 and bool((vis_a | hid_a).all()):  # a constant mask
        p = torch.zeros(*vis_a.shape, 1, x.p.shape[-1], dtype=torch.long)
        p[..., 0, 0] = torch.where(vis_a, 0, -1)
        return _Bool(p)
    if bool((vis_a & hid_b).all()):
        return _Bool(x.p)
    if bool((hid_a & vis_b).all()):
        return _negate(_Bool(x.p), "the additive mask")
    raise Unprovable("the additive mask has values other than 0 and -inf")


def _squash(x):
    """x with its broadcast (stride-0, expanded) dims cut to size 1: the same mask, nothing materialized."""
    shape, parts = _shape(x), _parts(x)
    idx = tuple(slice(0, 1) if size > 1 and all(t.stride(d) == 0 for t in parts) else slice(None)
                for d, size in enumerate(shape))
    return _map(x, lambda t, e: t[idx])


def _causal_t(form: torch.Tensor, j: torch.Tensor, unit: torch.Tensor) -> torch.Tensor | None:
    """T [mb, mh, ms, n + 1] if form [mb, mh, ms, L, n + 1] is T - j everywhere, else None."""
    t = form[:, :, :, 0]
    return t if bool((form == t[:, :, :, None] - j[:, None] * unit).all()) else None


def prove_causal(mask: fx.Node, *, batch: int, heads: int, q_len: int, kv_len: int,
                 graph_module: fx.GraphModule | None = None) -> CausalMask:
    """Proves mask (broadcastable to [batch, heads, q_len, kv_len]) is position-causal; see the module doc."""
    value, leaves = evaluate(mask, graph_module)
    m = _compact(_as_bool(_squash(value)))
    shape = _shape(m)
    if len(shape) > 4:
        raise Unprovable(f"the mask has {len(shape)} dims")
    shape = (1,) * (4 - len(shape)) + shape
    for size, full, what in zip(shape, (batch, heads, q_len, kv_len), ("batch", "heads", "queries", "keys")):
        if size not in (1, full):
            raise Unprovable(f"the mask's {what} dim is {size}, not 1 or {full}")
    k = m.p.shape[-2]
    if k == 0:
        return CausalMask(causal=False)
    if k > 2:
        raise Unprovable(f"the mask is a conjunction of {k} position conditions")
    if shape[3] != kv_len:
        raise Unprovable("the mask does not vary along the keys")
    forms = m.p.reshape(*shape, k, -1)  # [mb, mh, ms, L, k, n + 1]
    unit = torch.zeros(forms.shape[-1], dtype=torch.long)
    unit[0] = 1
    j = torch.arange(kv_len)
    window_left = -1
    if k == 2:  # causal and a window: (T - j >= 0) and (j - T + W >= 0), W the same everywhere
        both = forms.sum(-2)
        w = int(both.flatten()[0])
        if bool(both[..., 1:].any()) or not bool((both[..., 0] == w).all()) or w < 0:
            raise Unprovable("the mask is a conjunction of two conditions that are not causal + a window")
        window_left = w
        causal_slot = [i for i in range(2) if _causal_t(forms[..., i, :], j, unit) is not None]
        if not causal_slot:
            raise Unprovable("the mask is not 'key <= query position' (not causal up to a position)")
        form = forms[..., causal_slot[0], :]
    else:
        form = forms[..., 0, :]
    if not bool(form[..., 1:].any()):  # a constant mask: each row must be a prefix of the keys
        truth = form[..., 0] >= 0
        count = truth.sum(-1)
        if not bool((truth == (j < count[..., None])).all()):
            raise Unprovable("the constant mask is not a prefix of the keys in every row")
        t = (count - 1)[..., None] * unit
    else:
        t = _causal_t(form, j, unit)  # T[b, h, i]: key j visible iff j <= T
        if t is None:
            raise Unprovable("the mask is not 'key <= query position' (not causal up to a position)")
    if not bool((t == t[:, :1]).all()):
        raise Unprovable("the mask differs between heads")
    t = t[:, 0]  # [mb, ms, n + 1]
    if shape[2] != q_len and q_len > 1:
        raise Unprovable("every query row has the same mask")
    steps = torch.arange(q_len - 1, -1, -1)[:, None] * unit if shape[2] == q_len else 0
    if not bool((t == t[:, -1:] - steps).all()):
        raise Unprovable("the queries' positions are not provably consecutive (runtime positions of several "
                         "queries)")
    last = t[:, -1]  # [mb, n + 1]
    if not bool((last[:, 0] == last[0, 0]).all()):
        raise Unprovable("requests have different constant offsets")
    offset = int(last[0, 0]) + 1
    coef = last[:, 1:]
    if not bool(coef.any()):
        return CausalMask(causal=True, offset=offset, window_left=window_left)
    if not bool(((coef != 0).sum(-1) == 1).all() & (coef.sum(-1) == 1).all()):
        raise Unprovable("the query position is not a single runtime integer plus a constant")
    var = coef.argmax(-1)
    leaf = max((node for node, first in leaves.items() if first <= int(var[0])), key=leaves.get)
    flat = var - leaves[leaf]
    stride = int(flat[1] - flat[0]) if flat.numel() > 1 else 0
    if not bool((flat == flat[0] + stride * torch.arange(flat.numel())).all()) or bool((var < leaves[leaf]).any()) \
            or bool((flat >= _numel(_static_shape(leaf))).any()):
        raise Unprovable("requests read their positions in an irregular layout")
    return CausalMask(causal=True, leaf=leaf, index=int(flat[0]), stride=stride, offset=offset,
                      window_left=window_left)


def position_forms(node: fx.Node, graph_module: fx.GraphModule | None = None) -> set[tuple[fx.Node, int, int]]:
    """The elements of an integer tensor that are one runtime integer plus a constant, as (leaf, flat index
    into the leaf, constant); empty where the tensor is not analyzable."""
    try:
        value, leaves = evaluate(node, graph_module)
    except Exception:  # Unprovable, or anything unexpected: no evidence
        return set()
    if not isinstance(value, _Int):
        return set()
    forms = set()
    for row in value.c.reshape(-1, value.c.shape[-1]).tolist():
        coef = [(i, c) for i, c in enumerate(row[1:]) if c]
        if len(coef) == 1 and coef[0][1] == 1:
            var = coef[0][0]
            leaf = max((n for n, first in leaves.items() if first <= var), key=leaves.get)
            forms.add((leaf, var - leaves[leaf], row[0]))
    return forms

