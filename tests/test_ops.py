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


@pytest.mark.parametrize("ids", ["nan_pages", "out_of_range"])
@pytest.mark.parametrize("mode", list(MODES))
def test_page_ids_past_live_length_are_never_read(mode, ids):
    """Page-table columns past a request's live pages hold ids of pages full of NaN (a read would show as
    NaN in out or lse), or ids outside the pool (10**6, negative: a read would fail or wrap)."""
    page_size = 4
    args = make_problem(batch=2, page_size=page_size, seed=13, **{"max_pages": 6, **MODES[mode]})
    if not args["q"].dim() == 3:  # 4-D q: lengths that leave unused columns
        s = args["q"].shape[1]
        args["cache_seqlens"] = torch.tensor([s + 4, s + 8], dtype=torch.int32)
    lens, page_table = args["cache_seqlens"].tolist(), args["page_table"]
    live_cols = [-(-n // page_size) for n in lens]
    assert all(c < page_table.shape[1] for c in live_cols)  # every request has columns past its live pages
    last = args["k_cache"].shape[0] - 1
    unlisted = sorted(set(range(last)) - set(page_table.flatten().tolist()))  # make_problem leaves 3 pages out
    page_table[page_table == last] = unlisted[0]
    assert not (page_table == last).any()  # the last page is no one's: -1 (wrapped) lands on poison
    live = {int(page_table[b, j]) for b in range(len(lens)) for j in range(live_cols[b])}
    dead = [p for p in range(last + 1) if p not in live]
    args["k_cache"][dead] = float("nan")
    args["v_cache"][dead] = float("nan")
    for b, cols in enumerate(live_cols):
        if ids == "nan_pages":
            page_table[b, cols:] = torch.tensor(dead)[torch.arange(page_table.shape[1] - cols) % len(dead)]
            page_table[b, -1] = -1
        else:
            page_table[b, cols:] = 10**6 if b == 0 else -7
    out, lse = b12x.paged_attention(**args, return_lse=True)
    ref_out, ref_lse = paged_attention_reference(**args)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    if ids == "nan_pages":  # the poison is where a read would land: one more page per request reads NaN
        longer = dict(args, cache_seqlens=torch.tensor([c * page_size + 1 for c in live_cols], dtype=torch.int32))
        assert paged_attention_reference(**longer)[0].isnan().any()


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
