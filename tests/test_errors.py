"""Every bad input raises ValueError / TypeError naming the argument, eagerly and while tracing."""

from __future__ import annotations

import re

import pytest
import torch

import b12x_inductor as b12x
from tests.helpers import make_problem


def _raises(fn, exc, pattern, **kwargs):
    """Calls fn and checks that it raised exc matching pattern. Under torch.compile, Dynamo reports an error
    of a fake implementation wrapped in its own TorchRuntimeError: the original must be in the chain and its
    message in the wrapper's."""
    with pytest.raises(Exception) as info:
        fn(**kwargs)
    err = info.value
    chain = []
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    ours = [e for e in chain if type(e) is exc]
    assert ours, f"expected {exc.__name__}, got {[type(e).__name__ for e in chain]}"
    assert re.search(pattern, str(ours[0])), str(ours[0])
    assert str(ours[0]) in str(info.value)


def _base():
    args = make_problem(batch=2, q_len=1, hq=4, hkv=2, d=64, page_size=4, max_pages=4, seed=0)
    return args, {}


def _set(**changes):
    def f(args, opts):
        for k, val in changes.items():
            (args if k in args else opts)[k] = val(args) if callable(val) else val
    return f


F8 = torch.float8_e4m3fn
CASES = [
    ("q_dims", _set(q=lambda a: a["q"][0]), ValueError, r"cu_seqlens_q must be an int32 \[B \+ 1\] tensor"),
    ("q_dims_5", _set(q=lambda a: a["q"][None]), ValueError, r"q must be \[B, S, Hq, D\] or packed"),
    ("q_dtype", _set(q=lambda a: a["q"].double()), TypeError, "q must be of dtype"),
    ("q_stride", _set(q=lambda a: a["q"].transpose(-1, -2).contiguous().transpose(-1, -2)), ValueError,
     "q must be contiguous in its last"),
    ("q_empty", _set(q=lambda a: a["q"][:, :0]), ValueError, "q must be at least one token"),
    ("q_batch", _set(q=lambda a: torch.randn(3, 1, 4, 64)), ValueError, r"q must be of batch 2"),
    ("head_dim", _set(q=lambda a: torch.randn(2, 1, 4, 32), k_cache=lambda a: torch.randn(20, 4, 2, 32),
                      v_cache=lambda a: torch.randn(20, 4, 2, 32)), ValueError, "q must be of head dim 64"),
    ("kv_head_dim", _set(k_cache=lambda a: torch.randn(20, 4, 2, 128), v_cache=lambda a: torch.randn(20, 4, 2, 128)),
     ValueError, "k_cache must be of q's head dim 64"),
    ("gqa", _set(k_cache=lambda a: torch.randn(20, 4, 3, 64), v_cache=lambda a: torch.randn(20, 4, 3, 64)),
     ValueError, "divisible by the cache's 3 KV heads"),
    ("layout", _set(kv_layout="NDH"), ValueError, "kv_layout must be 'NHD' or 'HND'"),
    ("cache_dims", _set(k_cache=lambda a: a["k_cache"][0]), ValueError, "k_cache must be 4-dimensional"),
    ("cache_shapes", _set(v_cache=lambda a: a["v_cache"][:-1]), ValueError, "v_cache must be of k_cache's shape"),
    ("cache_dtypes", _set(v_cache=lambda a: a["v_cache"].double()), TypeError, "v_cache must be of k_cache's dtype"),
    ("cache_dtype", _set(k_cache=lambda a: a["k_cache"].half(), v_cache=lambda a: a["v_cache"].half()), TypeError,
     "k_cache must be of q's dtype"),
    ("fp8_with_fp32_q", _set(k_cache=lambda a: a["k_cache"].to(F8), v_cache=lambda a: a["v_cache"].to(F8)),
     TypeError, "or torch.float8_e4m3fn \\(with bf16/fp16 q\\)"),
    ("cache_stride", _set(k_cache=lambda a: a["k_cache"].transpose(-1, -2).contiguous().transpose(-1, -2),
                          v_cache=lambda a: a["v_cache"].transpose(-1, -2).contiguous().transpose(-1, -2)),
     ValueError, "k_cache must be contiguous in its last"),
    ("page_table_dtype", _set(page_table=lambda a: a["page_table"].long()), TypeError, "page_table must be of dtype torch.int32"),
    ("page_table_dims", _set(page_table=lambda a: a["page_table"][0]), ValueError, "page_table must be 2-dimensional"),
    ("seqlens_dtype", _set(cache_seqlens=lambda a: a["cache_seqlens"].long()), TypeError, "cache_seqlens must be of dtype"),
    ("seqlens_shape", _set(cache_seqlens=lambda a: a["cache_seqlens"][:1]), ValueError, r"cache_seqlens must be of shape \(2,\)"),
    ("cu_with_4d", _set(cu_seqlens_q=lambda a: torch.zeros(3, dtype=torch.int32)), ValueError,
     "cu_seqlens_q must be None for a 4-dimensional q"),
    ("cu_shape", _set(q=lambda a: a["q"][:, 0], cu_seqlens_q=lambda a: torch.zeros(2, dtype=torch.int32)),
     ValueError, r"cu_seqlens_q must be of shape \(3,\)"),
    ("kv_start", _set(kv_start=torch.zeros(2, dtype=torch.int64)), TypeError, "kv_start must be of dtype torch.int32"),
    ("sinks", _set(sinks=torch.zeros(2)), ValueError, r"sinks must be of shape \(4,\)"),
    ("sinks_dtype", _set(sinks=torch.zeros(4, dtype=torch.float16)), TypeError, "sinks must be of dtype torch.float32"),
    ("descale_bf16", _set(k_descale=torch.tensor(1.0)), ValueError, "k_descale must be None for a cache that is not"),
    ("scale", _set(scale=-1.0), ValueError, "scale must be a positive finite float"),
    ("scale_tensor", _set(scale=torch.tensor(0.1)), TypeError,
     r"scale must be a Python float or int, or None \(a tensor scale is not taken.*; got Tensor"),
    ("scale_bool", _set(scale=True), TypeError, "scale must be a Python float or int.*; got bool True"),
    ("causal_int", _set(causal=1), TypeError, "causal must be a bool; got int 1"),
    ("causal_none", _set(causal=None), TypeError, "causal must be a bool; got NoneType"),
    ("window", _set(window_left=-2), ValueError, "window_left must be an int >= -1"),
    ("window_float", _set(window_left=2.5), TypeError, r"window_left must be an int >= -1 .*; got float 2.5"),
    ("window_bool", _set(window_left=True), TypeError, "window_left must be an int >= -1 .*; got bool True"),
    ("softcap", _set(softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
    ("softcap_tensor", _set(softcap=torch.tensor(2.0)), TypeError, "softcap must be a Python float or int"),
    ("layout_type", _set(kv_layout=1), TypeError, r"kv_layout must be 'NHD' or 'HND' \(a str\); got int 1"),
    ("return_lse", _set(return_lse=1), TypeError, "return_lse must be a bool; got int 1"),
    ("sinks_list", _set(sinks=[0.0] * 4), TypeError, "sinks must be a torch.Tensor or None; got list"),
    ("seqlens_list", _set(cache_seqlens=[1, 2]), TypeError, "cache_seqlens must be a torch.Tensor; got list"),
    ("zero_pages", _set(k_cache=lambda a: a["k_cache"][:0], v_cache=lambda a: a["v_cache"][:0]), ValueError,
     r"k_cache must be a cache with at least one page \(num_pages >= 1\); got shape \(0, 4, 2, 64\)"),
    ("zero_kv_heads", _set(k_cache=lambda a: a["k_cache"][:, :, :0], v_cache=lambda a: a["v_cache"][:, :, :0]),
     ValueError, "k_cache must be a cache with Hkv >= 1 KV heads"),
    ("zero_q_heads", _set(q=lambda a: a["q"][:, :, :0]), ValueError, r"q must be at least one head \(Hq >= 1\)"),
    ("out_shape", _set(out=lambda a: torch.empty(2, 1, 4, 32)), ValueError, "out must be of shape"),
    ("out_dtype", _set(out=lambda a: torch.empty(2, 1, 4, 64, dtype=torch.float16)), TypeError, "out must be of dtype"),
    # the value head dim Dv (v_cache's last dim) may differ from D: plan.py's table
    ("v_head_dim", _set(v_cache=lambda a: torch.randn(*a["v_cache"].shape[:-1], 32)), ValueError,
     "v_cache must be of value head dim 64, 96, 128, 192, 256, 512; got value head dim 32"),
    ("v_cache_heads", _set(v_cache=lambda a: torch.randn(11, 4, 1, 128)), ValueError,
     r"v_cache must be of k_cache's shape \(11, 4, 2\) in every dim but the last"),
    ("mla_dv", _set(q=lambda a: torch.randn(2, 1, 4, 576), k_cache=lambda a: torch.randn(11, 4, 1, 576),
                    v_cache=lambda a: torch.randn(11, 4, 1, 256)), ValueError,
     "v_cache must be of value head dim 512 with q/k head dim 576; got value head dim 256"),
    ("d576_dv576", _set(q=lambda a: torch.randn(2, 1, 4, 576), k_cache=lambda a: torch.randn(11, 4, 1, 576),
                        v_cache=lambda a: torch.randn(11, 4, 1, 576)), ValueError,
     "v_cache must be of value head dim 512 with q/k head dim 576"),
    ("head_dim_512", _set(q=lambda a: torch.randn(2, 1, 4, 512), k_cache=lambda a: torch.randn(11, 4, 1, 512),
                          v_cache=lambda a: torch.randn(11, 4, 1, 512)), ValueError,
     r"q must be of head dim 64, 96, 128, 192, 256 \(or 576 with a value head dim of 512\); got head dim 512"),
    ("out_dv", _set(v_cache=lambda a: torch.randn(*a["v_cache"].shape[:-1], 128),
                    out=lambda a: torch.empty(2, 1, 4, 64)), ValueError, r"out must be of shape \(2, 1, 4, 128\)"),
]


WHERE = ["eager", "compiled", "inductor"]  # compiled: backend="eager" (Dynamo only); inductor: the default backend


def _where(fn, where):
    if where == "eager":
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager" if where == "compiled" else "inductor")


@pytest.mark.parametrize("name,change,exc,message", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("where", WHERE)
def test_paged_attention_bad_input(name, change, exc, message, where):
    args, opts = _base()
    change(args, opts)
    _raises(_where(b12x.paged_attention, where), exc, "^paged_attention: .*" + message, **args, **opts)


def test_paged_attention_good_input_still_runs_in_every_where():
    """The bad-input cases are only meaningful if the unchanged base call runs in each `where`."""
    args, opts = _base()
    expected = b12x.paged_attention(**args, **opts)
    for where in WHERE[1:]:
        torch.testing.assert_close(_where(b12x.paged_attention, where)(**args, **opts), expected)


def test_fp8_descale_shape():
    args = make_problem(batch=2, q_len=1, hq=4, hkv=2, d=64, dtype=torch.bfloat16, kv_dtype=F8)
    with pytest.raises(ValueError, match=r"k_descale must be a scalar, \[B\] = \(2,\) or \[B, Hkv\] = \(2, 2\); got shape \(3,\)"):
        b12x.paged_attention(**args, k_descale=torch.ones(3))


WRITE_CASES = [
    ("k_dims", dict(k=torch.randn(3, 64)), ValueError, "k must be 3-dimensional"),
    ("v_shape", dict(v=torch.randn(3, 2, 32)), ValueError, "v must be of shape"),
    ("heads", dict(k=torch.randn(3, 4, 64), v=torch.randn(3, 4, 64)), ValueError, r"k must be of shape \[N, Hkv, D\]"),
    ("slots_dtype", dict(slot_mapping=torch.zeros(3, dtype=torch.int32)), TypeError, "slot_mapping must be of dtype torch.int64"),
    ("slots_shape", dict(slot_mapping=torch.zeros(2, dtype=torch.int64)), ValueError, r"slot_mapping must be of shape \(3,\)"),
    ("cache_dtype", dict(k_cache=torch.randn(5, 4, 2, 64).half(), v_cache=torch.randn(5, 4, 2, 64).half()), TypeError,
     "k_cache must be of k's dtype"),
    ("scale_not_fp8", dict(k_scale=torch.tensor(1.0)), ValueError, "k_scale must be None for a cache that is not"),
    ("layout", dict(kv_layout="X"), ValueError, "kv_layout must be 'NHD' or 'HND'"),
    ("layout_type", dict(kv_layout=None), TypeError, r"kv_layout must be 'NHD' or 'HND' \(a str\); got NoneType"),
    ("scale_float", dict(k_scale=0.5), TypeError, "k_scale must be a torch.Tensor or None; got float 0.5"),
    ("slots_list", dict(slot_mapping=[0, 1, 2]), TypeError, "slot_mapping must be a torch.Tensor; got list"),
    ("zero_pages", dict(k_cache=torch.randn(0, 4, 2, 64), v_cache=torch.randn(0, 4, 2, 64)), ValueError,
     "k_cache must be a cache with at least one page"),
    ("zero_kv_heads", dict(k=torch.randn(3, 0, 64), v=torch.randn(3, 0, 64), k_cache=torch.randn(5, 4, 0, 64),
                           v_cache=torch.randn(5, 4, 0, 64)), ValueError, "k_cache must be a cache with Hkv >= 1"),
    ("v_head_dim", dict(v_cache=torch.randn(5, 4, 2, 128)), ValueError, r"v must be of shape \(3, 2, 128\)"),
]


def _write_args():
    return dict(k=torch.randn(3, 2, 64), v=torch.randn(3, 2, 64), k_cache=torch.randn(5, 4, 2, 64),
                v_cache=torch.randn(5, 4, 2, 64), slot_mapping=torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("name,change,exc,message", WRITE_CASES, ids=[c[0] for c in WRITE_CASES])
@pytest.mark.parametrize("where", WHERE)
def test_write_kv_bad_input(name, change, exc, message, where):
    args = _write_args()
    args.update(change)
    _raises(_where(b12x.write_kv, where), exc, "^write_kv: .*" + message, **args)


@pytest.fixture
def debug(monkeypatch):
    monkeypatch.setenv("B12X_DEBUG", "1")


@pytest.mark.parametrize("case", ["page_id", "length", "kv_start", "cu", "new_tokens"])
def test_device_values_checked_under_debug(debug, case):
    args = make_problem(batch=2, q_len=1, hq=4, hkv=2, d=64, page_size=4, max_pages=4, seed=1)
    args["cache_seqlens"] = torch.tensor([5, 9], dtype=torch.int32)
    opts = {}
    if case == "page_id":
        args["page_table"][1, 2] = 999
        match = r"page_table\[1\] must be page ids in \[0, 11\)"
    elif case == "length":
        args["cache_seqlens"][0] = 17
        match = r"cache_seqlens must be in \[0, 16\]"
    elif case == "kv_start":
        opts["kv_start"] = torch.tensor([0, 10], dtype=torch.int32)
        match = "kv_start must be in"
    elif case == "cu":
        args["q"] = torch.randn(3, 4, 64)
        args["cu_seqlens_q"] = torch.tensor([0, 2, 1], dtype=torch.int32)
        match = "cu_seqlens_q must be non-decreasing"
    else:
        args["cache_seqlens"][0] = 0
        match = "cache_seqlens must be at least each request's new-token count"
    with pytest.raises(ValueError, match=match):
        b12x.paged_attention(**args, **opts)


def test_write_kv_slot_checked_under_debug(debug):
    with pytest.raises(ValueError, match=r"slot_mapping must be slots < num_pages \* page_size = 20"):
        b12x.write_kv(torch.randn(2, 2, 64), torch.randn(2, 2, 64), torch.randn(5, 4, 2, 64),
                      torch.randn(5, 4, 2, 64), torch.tensor([3, 20]))


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_debug_is_off_by_default(monkeypatch, value, on):
    """Without B12X_DEBUG (or with it 0 or empty) no device value is checked (no host sync); any other value
    turns the checks on. The call has a live page id out of range, which only the debug check catches."""
    from b12x_inductor import validate

    if value is None:
        monkeypatch.delenv("B12X_DEBUG", raising=False)
    else:
        monkeypatch.setenv("B12X_DEBUG", value)
    assert validate.debug_enabled() is on
    checked = []

    def check_device_values(*args):
        checked.append(args)
        raise ValueError("device values checked")

    monkeypatch.setattr(validate, "check_device_values", check_device_values)
    args = make_problem(batch=2, q_len=1, hq=4, hkv=2, d=64, page_size=4, max_pages=4, seed=1)
    if on:
        with pytest.raises(ValueError, match="device values checked"):
            b12x.paged_attention(**args)
    else:
        b12x.paged_attention(**args)
    assert len(checked) == int(on)


@pytest.mark.parametrize("name", ["cache_seqlens", "kv_start", "sinks"])
def test_strided_vectors_are_rejected(name):
    args, opts = _base()
    vec = {"cache_seqlens": args["cache_seqlens"], "kv_start": torch.zeros(2, dtype=torch.int32),
           "sinks": torch.randn(4)}[name]
    strided = torch.stack([vec, vec], dim=1)[:, 0]  # a view with stride 2
    (args if name in args else opts)[name] = strided
    _raises(b12x.paged_attention, ValueError, f"^paged_attention: {name} must be contiguous; got strides \\(2,\\)",
            **args, **opts)
