"""The ops have no backward: with grad mode on, an input that requires grad raises a RuntimeError naming the op
(eagerly, with backend="eager" and with Inductor), never an output whose gradient silently stays None.
Inference (torch.no_grad, torch.inference_mode, inputs that do not require grad) is untouched."""

from __future__ import annotations

import pytest
import torch

import b12x_inductor as b12x
from b12x_inductor.kernels.reference import paged_attention_reference
from tests.helpers import make_problem

WHERE = ["eager", "compiled", "inductor"]


def _where(fn, where):
    if where == "eager":
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager" if where == "compiled" else "inductor")


def _args():
    args = make_problem(batch=2, q_len=1, hq=4, hkv=2, d=64, page_size=4, max_pages=4, seed=5)
    return args, dict(sinks=torch.randn(4))


def _attend(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, sinks):
    return b12x.paged_attention(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, sinks=sinks) * 2


def _attend_out(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, sinks):
    out = torch.empty_like(q)
    b12x.paged_attention(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, sinks=sinks, out=out)
    return out * 2


def _refused(err: BaseException, pattern: str) -> bool:
    chain = []
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return any(type(e) is RuntimeError and pattern in str(e) for e in chain)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("fn", [_attend, _attend_out], ids=["functional", "out"])
@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "sinks"])
def test_required_gradient_is_refused(name, fn, where):
    args, opts = _args()
    both = {**args, **opts}
    both[name] = both[name].clone().requires_grad_()
    with pytest.raises(Exception) as info:
        _where(fn, where)(**both)
    assert _refused(info.value, f"paged_attention: {name} requires grad with grad mode on, but paged_attention "
                                "has no backward"), repr(info.value)


@pytest.mark.parametrize("where", WHERE)
def test_a_non_leaf_that_requires_grad_is_refused(where):
    args, opts = _args()
    w = torch.nn.Parameter(torch.ones(()))
    with pytest.raises(Exception) as info:
        _where(lambda q, **kw: _attend(q * w, **kw), where)(**args, **opts)
    assert _refused(info.value, "paged_attention: q requires grad"), repr(info.value)


@pytest.mark.parametrize("where", WHERE)
def test_write_kv_required_gradient_is_refused(where):
    k = torch.randn(3, 2, 64, requires_grad=True)
    caches = torch.randn(5, 4, 2, 64), torch.randn(5, 4, 2, 64)
    with pytest.raises(Exception) as info:
        _where(b12x.write_kv, where)(k, torch.randn(3, 2, 64), *caches, torch.tensor([0, 1, 2]))
    assert _refused(info.value, "write_kv: k requires grad with grad mode on"), repr(info.value)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "no_input_requires_grad"])
def test_inference_is_untouched(context, where):
    """Parameters that require grad (gpt-oss's sinks are an nn.Parameter) under no_grad, as in generate."""
    args, opts = _args()
    expected = paged_attention_reference(**args, **opts)[0] * 2
    both = {**args, **opts}
    if context != "no_input_requires_grad":
        both["q"] = both["q"].clone().requires_grad_()
        both["sinks"] = torch.nn.Parameter(both["sinks"].clone())
    fn = _where(_attend, where)
    if context == "no_grad":
        with torch.no_grad():
            got = fn(**both)
    elif context == "inference_mode":
        with torch.inference_mode():
            got = fn(**{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in both.items()})
    else:
        got = fn(**both)
    assert not got.requires_grad
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_write_kv_under_no_grad_with_grad_inputs():
    k, v = torch.randn(2, 2, 64, requires_grad=True), torch.randn(2, 2, 64, requires_grad=True)
    k_cache, v_cache = torch.zeros(3, 4, 2, 64), torch.zeros(3, 4, 2, 64)
    with torch.no_grad():
        b12x.write_kv(k, v, k_cache, v_cache, torch.tensor([1, 6]))
    assert torch.equal(k_cache[0, 1], k.detach()[0]) and torch.equal(v_cache[1, 2], v.detach()[1])
    assert not k_cache.requires_grad


def test_direct_op_call_is_refused_too():
    """The check is the op's Autograd kernel, not only the Python function's."""
    args, opts = _args()
    q = args.pop("q").clone().requires_grad_()
    with pytest.raises(RuntimeError, match="paged_attention: q requires grad"):
        torch.ops.b12x.paged_attention(q, *args.values(), **opts)
