"""The reference against an independent naive loop (float64, one key at a time), feature by feature."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from b12x_inductor.kernels.reference import paged_attention_reference
from tests.helpers import make_problem


def naive(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=None, *, kv_layout="NHD", causal=True,
          scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None, v_descale=None):
    """Written apart from kernels/reference.py: flatten q to (request, index, new count) rows and walk keys."""
    d = q.shape[-1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    nhd = kv_layout == "NHD"
    page_size = k_cache.shape[1] if nhd else k_cache.shape[2]
    hkv = k_cache.shape[2] if nhd else k_cache.shape[1]
    hq = q.shape[-2]
    rows = []  # (index into q, request, position among its new tokens, number of new tokens)
    if q.dim() == 4:
        for b in range(q.shape[0]):
            for i in range(q.shape[1]):
                rows.append(((b, i), b, i, q.shape[1]))
    else:
        for b in range(page_table.shape[0]):
            lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            for t in range(lo, hi):
                rows.append(((t,), b, t - lo, hi - lo))
    out = torch.zeros(q.shape[:-1] + (v_cache.shape[-1],), dtype=torch.float64)  # v's head dim
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float64)

    def descale(ds, b, kh):
        if ds is None:
            return 1.0
        return float(ds) if ds.dim() == 0 else float(ds[b] if ds.dim() == 1 else ds[b, kh])

    for idx, b, i, n_new in rows:
        length = int(cache_seqlens[b])
        c = length - n_new + i
        first = 0 if kv_start is None else int(kv_start[b])
        for h in range(hq):
            kh = h // (hq // hkv)
            logits, values = [], []
            for j in range(length):
                if j < first or (causal and j > c) or (window_left >= 0 and j < c - window_left):
                    continue
                page, off = int(page_table[b, j // page_size]), j % page_size
                kv_idx = (page, off, kh) if nhd else (page, kh, off)
                key = k_cache[kv_idx].double() * descale(k_descale, b, kh)
                val = v_cache[kv_idx].double() * descale(v_descale, b, kh)
                s = float(q[idx + (h,)].double() @ key) * scale
                if softcap > 0:
                    s = softcap * math.tanh(s / softcap)
                logits.append(s)
                values.append(val)
            if not logits:
                continue
            m = max(logits + ([float(sinks[h])] if sinks is not None else []))
            denom = sum(math.exp(s - m) for s in logits) + (math.exp(float(sinks[h]) - m) if sinks is not None else 0)
            out[idx + (h,)] = sum(math.exp(s - m) / denom * v for s, v in zip(logits, values))
            lse[idx + (h,)] = m + math.log(denom)
    return out, lse


def _check(args, **opts):
    ref_out, ref_lse = paged_attention_reference(**args, **opts)
    exp_out, exp_lse = naive(**args, **opts)
    torch.testing.assert_close(ref_out.double(), exp_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_lse.double(), exp_lse, atol=1e-5, rtol=1e-5)
    assert ref_out.abs().sum() > 0  # the case attends to something


CASES = {
    "plain": {},
    "window": dict(window_left=3),
    "kv_start": "kv_start",
    "sinks": "sinks",
    "softcap": dict(softcap=2.0),
    "scale": dict(scale=0.3),
    "non_causal": dict(causal=False),
}


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_naive_loop(case, q_len):
    args = make_problem(batch=2, q_len=q_len, hq=4, hkv=2, d=64, page_size=3, max_pages=4, seed=zlib.crc32(case.encode()) % 1000)
    opts = CASES[case]
    if opts == "kv_start":
        opts = dict(kv_start=torch.tensor([1, 2], dtype=torch.int32))
    elif opts == "sinks":
        opts = dict(sinks=torch.randn(4))
    _check(args, **opts)


def test_reference_hnd_and_packed():
    args = make_problem(batch=3, q_len=9, packed=True, hq=4, hkv=1, d=64, page_size=2, max_pages=6,
                        kv_layout="HND", new_lens=[2, 1, 3], seed=5)
    _check(args, kv_layout="HND")
    out, lse = paged_attention_reference(**args, kv_layout="HND")
    assert (out[6:] == 0).all() and torch.isneginf(lse[6:]).all()  # capacity padding rows


def test_reference_fp8_descales():
    args = make_problem(batch=2, q_len=2, hq=4, hkv=2, d=64, kv_dtype=torch.float8_e4m3fn,
                        dtype=torch.bfloat16, seed=7)
    for kd, vd in ((torch.tensor(0.5), torch.tensor(0.25)), (torch.rand(2) + 0.1, torch.rand(2, 2) + 0.1)):
        _check(args, k_descale=kd, v_descale=vd)


def test_reference_request_without_keys():
    args = make_problem(batch=2, q_len=1, hq=4, hkv=2, d=64, seed=9)
    args["cache_seqlens"] = torch.tensor([0, 5], dtype=torch.int32)
    out, lse = paged_attention_reference(**args)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    _check(args)
    # a window and kv_start that hide every key of request 1's only query
    out, lse = paged_attention_reference(**args, kv_start=torch.tensor([0, 5], dtype=torch.int32))
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("dv", [32, 128])
@pytest.mark.parametrize("q_len", [1, 3])
def test_reference_value_head_dim_differs(dv, q_len):
    """v_cache's head dim Dv != D: logits over D, out [.., Dv] (the naive loop sums Dv-dim values)."""
    args = make_problem(batch=2, q_len=q_len, hq=4, hkv=2, d=64, page_size=3, max_pages=4, seed=dv + q_len)
    gen = torch.Generator().manual_seed(dv)
    args["v_cache"] = torch.randn(*args["v_cache"].shape[:-1], dv, generator=gen)
    out, _ = paged_attention_reference(**args)
    assert out.shape == args["q"].shape[:-1] + (dv,)
    _check(args, window_left=2, sinks=torch.randn(4, generator=gen))
