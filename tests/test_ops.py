"""The eager ops (torch family on CPU) against the reference, per mode and per feature; write_kv."""

from __future__ import annotations

import pytest
import torch

import b12x_inductor as b12x
from b12x_inductor.kernels.reference import paged_attention_reference, write_kv_reference
from tests.helpers import make_problem

MODES = {
    "decode": dict(q_len=1),
    "verify": dict(q_len=4),
    "extend": dict(q_len=20, max_pages=10),
    "packed": dict(q_len=12, packed=True, max_pages=6),
}
FEATURES = {
    "plain": lambda a: {},
    "window": lambda a: dict(window_left=5),
    "kv_start": lambda a: dict(kv_start=torch.minimum(a["cache_seqlens"], torch.tensor(3)).int()),
    "sinks": lambda a: dict(sinks=torch.randn(a["q"].shape[-2])),
    "softcap": lambda a: dict(softcap=3.0),
    "scale": lambda a: dict(scale=0.2),
    "non_causal": lambda a: dict(causal=False),
    "hnd": lambda a: dict(kv_layout="HND"),
}
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _compare(args, opts, dtype):
    out, lse = b12x.paged_attention(**args, **opts, return_lse=True)
    ref_out, ref_lse = paged_attention_reference(**args, **opts)
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    torch.testing.assert_close(out.float(), ref_out, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    return out


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("mode", list(MODES))
def test_paged_attention_matches_reference(mode, feature):
    kv_layout = "HND" if feature == "hnd" else "NHD"
    args = make_problem(hq=8, hkv=2, d=64, page_size=3, kv_layout=kv_layout, seed=len(mode) * 31 + len(feature),
                        **{"max_pages": 8, **MODES[mode]})
    _compare(args, FEATURES[feature](args), torch.float32)


@pytest.mark.parametrize("mode", list(MODES))
def test_bf16_and_fp8(mode):
    args = make_problem(hq=4, hkv=4, d=128, page_size=16, dtype=torch.bfloat16, seed=3,
                        **{"max_pages": 4, **MODES[mode]})
    _compare(args, {}, torch.bfloat16)
    fp8 = make_problem(hq=4, hkv=2, d=128, page_size=16, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                       seed=4, **{"max_pages": 4, **MODES[mode]})
    _compare(fp8, dict(k_descale=torch.rand(3, 2) + 0.5, v_descale=torch.tensor(0.7)), torch.bfloat16)


@pytest.mark.parametrize("d", [96, 192, 256])
def test_head_dims(d):
    args = make_problem(batch=2, q_len=2, hq=2, hkv=1, d=d, page_size=5, max_pages=3, seed=d)
    _compare(args, {}, torch.float32)


def test_no_visible_keys_and_padding_rows():
    args = make_problem(batch=3, q_len=10, packed=True, new_lens=[2, 1, 3], seed=11)
    args["cache_seqlens"] = torch.tensor([2, 1, 3], dtype=torch.int32)
    out, lse = b12x.paged_attention(**args, kv_start=torch.tensor([0, 1, 0], dtype=torch.int32), return_lse=True)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()  # request 1 sees nothing
    assert (out[6:] == 0).all() and torch.isneginf(lse[6:]).all()  # capacity padding
    assert out[:2].abs().sum() > 0


def test_out_argument_and_views_of_a_combined_cache():
    args = make_problem(batch=2, q_len=1, seed=12)
    kv = torch.stack([args["k_cache"], args["v_cache"]], dim=1)  # [num_pages, 2, page_size, Hkv, D]
    args["k_cache"], args["v_cache"] = kv[:, 0], kv[:, 1]
    out = torch.full_like(args["q"], float("nan"))
    res = b12x.paged_attention(**args, out=out)
    assert res is out
    torch.testing.assert_close(out, paged_attention_reference(**args)[0], atol=2e-5, rtol=2e-5)


def test_page_ids_past_live_length_are_never_read():
    args = make_problem(batch=2, q_len=1, page_size=4, max_pages=6, seed=13)
    args["cache_seqlens"] = torch.tensor([5, 9], dtype=torch.int32)
    args["page_table"][0, 2:] = 10**6  # garbage beyond request 0's two live pages
    args["page_table"][1, 3:] = -7
    ref = paged_attention_reference(**args)[0]
    torch.testing.assert_close(b12x.paged_attention(**args), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_write_kv_matches_reference(kv_layout, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    shape = (6, 4, 2, 64) if kv_layout == "NHD" else (6, 2, 4, 64)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    k, v = torch.randn(5, 2, 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
    slots = torch.tensor([3, -1, 17, 0, -5], dtype=torch.int64)
    scales = {}
    if cache_dtype == torch.float8_e4m3fn:
        scales = dict(k_scale=torch.tensor(0.5), v_scale=torch.rand(5, 2, generator=gen) + 0.5)
    original = k_cache.clone()
    ek, ev = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, ek, ev, slots, kv_layout=kv_layout, **scales)
    b12x.write_kv(k, v, k_cache, v_cache, slots, kv_layout=kv_layout, **scales)
    assert torch.equal(k_cache.float(), ek.float()) and torch.equal(v_cache.float(), ev.float())
    assert not torch.equal(k_cache.float(), original.float())  # the three kept tokens landed


def test_write_kv_all_skipped_changes_nothing():
    k_cache, v_cache = torch.randn(3, 4, 2, 64), torch.randn(3, 4, 2, 64)
    before = k_cache.clone(), v_cache.clone()
    b12x.write_kv(torch.randn(2, 2, 64), torch.randn(2, 2, 64), k_cache, v_cache, torch.tensor([-1, -1]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
