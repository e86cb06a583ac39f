"""Value head dim != key head dim (MLA) on CPU: the reference against plain attention over decompressed K/V, the
torch family against the reference with unused slots NaN-poisoned, `mla_attention` eager and compiled, bad
shapes. (The Triton family's Dv != D cases: tests/test_triton_kernels.py, INTERPRETER_CASES and GPU_CASES.)

DeepSeek-V3's attention, one layer: per token a latent c (kv_lora_rank 512) and a rope key k_pe (64, shared by
the heads); head h's key is [c @ W_UK[h], k_pe] (128 + 64 = 192) and its value c @ W_UV[h] (128). Non-absorbed,
that is paged attention with D = 192, Dv = 128; absorbed (W_UK folded into q, W_UV applied after), attention
over the latent cache itself with D = 576, Dv = 512 and one KV head.
"""

from __future__ import annotations

import re

import pytest
import torch

import b12x_inductor as b12x
from b12x_inductor.kernels.reference import paged_attention_reference
from tests import helpers
from tests.test_errors import _raises, _where
from tests.test_triton_kernels import check_close, make_inputs

RANK, ROPE, NOPE, VDIM = 512, 64, 128, 128  # DeepSeek-V3's kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim,
#                                             v_head_dim
SCALE = (NOPE + ROPE) ** -0.5  # the 192-dim qk head's softmax scale (DeepSeek-V3 also multiplies YaRN's mscale^2)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from helpers.one_thread()


# ----------------------------------------------------------------------------------------------------------
# A DeepSeek-style layer: latent cache, decompressed K/V, plain attention


def _mla_layer(*, batch=2, q_len=1, heads=4, page_size=4, lens=(9, 14), seed=0, packed=False, q_lens=None):
    """Random latent tokens paged into a [num_pages, page_size, 576] cache (pages in random order, unused
    slots NaN), weights W_UK [H, 128, 512] and W_UV [H, 512, 128], queries q_nope [.., H, 128] and q_pe
    [.., H, 64]. Returns a dict; the tokens per request are kept for the plain computation."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lens) + 1
    num_pages = batch * max_pages + 2
    cache = torch.full((num_pages, page_size, RANK + ROPE), float("nan"), dtype=torch.float64)
    page_table = torch.randperm(num_pages, generator=gen)[: batch * max_pages].reshape(batch, max_pages)
    latents = []
    for b, n in enumerate(lens):
        tokens = torch.randn(n, RANK + ROPE, generator=gen, dtype=torch.float64)
        j = torch.arange(n)
        cache[page_table[b, j // page_size], j % page_size] = tokens
        latents.append(tokens)
    w_uk = torch.randn(heads, NOPE, RANK, generator=gen, dtype=torch.float64) / RANK ** 0.5
    w_uv = torch.randn(heads, RANK, VDIM, generator=gen, dtype=torch.float64) / RANK ** 0.5
    if packed:
        q_lens = list(q_lens)
        cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
        rows = int(cu[-1]) + 2  # two padding rows
        q_nope = torch.randn(rows, heads, NOPE, generator=gen, dtype=torch.float64)
        q_pe = torch.randn(rows, heads, ROPE, generator=gen, dtype=torch.float64)
    else:
        q_lens, cu = [q_len] * batch, None
        q_nope = torch.randn(batch, q_len, heads, NOPE, generator=gen, dtype=torch.float64)
        q_pe = torch.randn(batch, q_len, heads, ROPE, generator=gen, dtype=torch.float64)
    return dict(cache=cache, page_table=page_table.int(), cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                cu_seqlens_q=cu, q_lens=q_lens, latents=latents, w_uk=w_uk, w_uv=w_uv, q_nope=q_nope, q_pe=q_pe)


def _query_rows(layer, b):
    """(q_nope, q_pe) rows of request b: [S_b, H, 128], [S_b, H, 64]."""
    if layer["cu_seqlens_q"] is None:
        return layer["q_nope"][b], layer["q_pe"][b]
    lo, hi = int(layer["cu_seqlens_q"][b]), int(layer["cu_seqlens_q"][b + 1])
    return layer["q_nope"][lo:hi], layer["q_pe"][lo:hi]


def _plain_attention(layer):
    """Written apart from the kernels and the reference: per request, decompress K and V from the latent
    tokens and run SDPA (float64, a causal mask aligned to the last S_b positions). Returns out
    [.., H, 128] in q's row layout (padding rows zero)."""
    out = torch.zeros(layer["q_nope"].shape[:-1] + (VDIM,), dtype=torch.float64)
    for b, tokens in enumerate(layer["latents"]):
        c, k_pe = tokens[:, :RANK], tokens[:, RANK:]
        k = torch.cat([torch.einsum("lr,hnr->hln", c, layer["w_uk"]),
                       k_pe.expand(layer["w_uk"].shape[0], -1, -1)], dim=-1)  # [H, L, 192]
        v = torch.einsum("lr,hrv->hlv", c, layer["w_uv"])  # [H, L, 128]
        q_nope, q_pe = _query_rows(layer, b)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, S, 192]
        s, length = q.shape[1], tokens.shape[0]
        visible = torch.arange(length)[None, :] <= (length - s + torch.arange(s))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=SCALE)
        o = o.transpose(0, 1)  # [S, H, 128]
        if layer["cu_seqlens_q"] is None:
            out[b] = o
        else:
            out[int(layer["cu_seqlens_q"][b]): int(layer["cu_seqlens_q"][b + 1])] = o
    return out


def _decompressed_cache(layer):
    """The non-absorbed paged caches: k [num_pages, page_size, H, 192] and v [.., H, 128] from each slot's latent
    (NaN slots stay NaN)."""
    c, k_pe = layer["cache"][..., :RANK], layer["cache"][..., RANK:]
    heads = layer["w_uk"].shape[0]
    k = torch.cat([torch.einsum("psr,hnr->pshn", c, layer["w_uk"]),
                   k_pe[:, :, None, :].expand(-1, -1, heads, -1)], dim=-1)
    return k, torch.einsum("psr,hrv->pshv", c, layer["w_uv"])


def _absorbed_q(layer):
    """q = [q_nope @ W_UK[h], q_pe] per head: [.., H, 576]."""
    return torch.cat([torch.einsum("...hn,hnr->...hr", layer["q_nope"], layer["w_uk"]), layer["q_pe"]], dim=-1)


def _up(layer, latent_out):
    """Absorbed output [.., H, 512] through W_UV: [.., H, 128]."""
    return torch.einsum("...hr,hrv->...hv", latent_out.double(), layer["w_uv"])


LAYERS = {"decode": dict(q_len=1), "verify": dict(q_len=3, lens=(5, 13)),
          "packed": dict(packed=True, q_lens=(4, 7), lens=(6, 11))}


@pytest.mark.parametrize("shape", list(LAYERS))
def test_reference_matches_plain_attention_over_decompressed_kv(shape):
    """The reference's Dv != D semantics from the math, both ways DeepSeek-V3 computes it: non-absorbed
    (D = 192, Dv = 128, Hkv = Hq) and absorbed (D = 576, Dv = 512 over the latent cache, then W_UV) equal SDPA
    over the decompressed K/V."""
    layer = _mla_layer(**LAYERS[shape], seed=len(shape))
    expected = _plain_attention(layer)
    assert expected.abs().sum() > 0
    rows = slice(None) if layer["cu_seqlens_q"] is None else slice(0, int(layer["cu_seqlens_q"][-1]))
    k, v = _decompressed_cache(layer)
    q = torch.cat([layer["q_nope"], layer["q_pe"]], dim=-1)
    out, _ = paged_attention_reference(q.float(), k.float(), v.float(), layer["page_table"], layer["cache_seqlens"],
                                       layer["cu_seqlens_q"], scale=SCALE)
    assert out.shape == expected.shape
    torch.testing.assert_close(out[rows].double(), expected[rows], atol=2e-5, rtol=2e-5)
    latent = layer["cache"].float()[:, :, None, :]
    out, _ = paged_attention_reference(_absorbed_q(layer).float(), latent, latent[..., :RANK], layer["page_table"],
                                       layer["cache_seqlens"], layer["cu_seqlens_q"], scale=SCALE)
    assert out.shape[-1] == RANK
    torch.testing.assert_close(_up(layer, out)[rows], expected[rows], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shape", ["decode", "packed"])
def test_mla_attention_matches_plain_attention(shape):
    """The public MLA entry (vLLM's latent cache, q_nope and q_pe apart) through W_UV equals SDPA over the
    decompressed K/V."""
    layer = _mla_layer(**LAYERS[shape], seed=7)
    q_abs = _absorbed_q(layer).float()
    out = b12x.mla_attention(q_abs[..., :RANK], q_abs[..., RANK:], layer["cache"].float(), layer["page_table"],
                             layer["cache_seqlens"], layer["cu_seqlens_q"], scale=SCALE)
    rows = slice(None) if layer["cu_seqlens_q"] is None else slice(0, int(layer["cu_seqlens_q"][-1]))
    torch.testing.assert_close(_up(layer, out)[rows], _plain_attention(layer)[rows], atol=5e-5, rtol=5e-5)
    if layer["cu_seqlens_q"] is not None:
        assert (out[int(layer["cu_seqlens_q"][-1]):] == 0).all()  # padding rows


# ----------------------------------------------------------------------------------------------------------
# The torch family against the reference, Dv != D


PAIRS = {"d192_dv128": dict(d=192, dv=128, hq=4, hkv=2), "mla576": dict(d=576, dv=512, hq=4, hkv=1, v_view=True)}
MODES = {"decode": dict(q_len=1), "verify": dict(q_len=4), "extend": dict(q_len=18),
         "packed_padded": dict(packed=True, q_lens=[6, 11])}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("pair", list(PAIRS))
def test_torch_family_matches_reference(pair, mode, page_size, monkeypatch):
    """fp32 q and caches; every slot no row sees is NaN; page size 1 takes the CUDA path (no host reads of
    device values), kv_start and a window on the 16-slot pages."""
    from b12x_inductor.kernels import torch_impl

    if page_size == 1:
        monkeypatch.setattr(torch_impl, "HOST_BOUNDS", False)
    lens = [MODES[mode].get("q_len", 11) + 13, 40]
    t = make_inputs(**PAIRS[pair], **MODES[mode], page_size=page_size, lens=lens, dtype=torch.float32,
                    nan_unused=True, kv_start=page_size == 16, seed=page_size + len(mode),
                    sinks=mode == "verify")
    opts = dict(scale=0.07, window_left=9 if page_size == 16 else -1)
    args = {k: t[k] for k in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "cu_seqlens_q")}
    extra = {k: t[k] for k in ("kv_start", "sinks")}
    out, lse = b12x.paged_attention(**args, **extra, **opts, return_lse=True)
    dv = t["v_cache"].shape[-1]
    assert out.shape == t["q"].shape[:-1] + (dv,) and torch.isfinite(out).all()
    ref_out, ref_lse = paged_attention_reference(**args, **extra, **opts)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    if t["cu_seqlens_q"] is not None:
        end = int(t["cu_seqlens_q"][-1])
        assert end < out.shape[0] and (out[end:] == 0).all() and torch.isneginf(lse[end:]).all()


def test_torch_family_bf16_fp8_and_out():
    """bf16 q with a float8 latent cache and its descales, out= of shape [.., Dv]."""
    t = make_inputs(d=576, dv=512, hq=8, hkv=1, v_view=True, q_len=2, page_size=16, kv_dtype=torch.float8_e4m3fn,
                    descale="b", nan_unused=True, seed=3)
    args = {k: t[k] for k in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "cu_seqlens_q")}
    out = torch.full(t["q"].shape[:-1] + (512,), float("nan"), dtype=torch.bfloat16)
    _, lse = b12x.paged_attention(**args, k_descale=t["k_descale"], v_descale=t["v_descale"], out=out,
                                  return_lse=True)
    check_close(out, lse, *paged_attention_reference(**args, k_descale=t["k_descale"], v_descale=t["v_descale"]),
                what="bf16/fp8 576/512")


def test_plans_for_dv():
    """Dv != D: the CuTe family refuses it (the Triton family plans it on an H200), tiles follow max(D, Dv),
    the split scratch is sized by Dv; Problem's v_head_dim defaults to head_dim."""
    from b12x_inductor.kernels import cute
    from b12x_inductor.plan import Problem, select_plan, split_scratch_bytes

    base = dict(batch=8, q_len=1, packed=False, num_q_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512,
                page_size=64, max_pages=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_layout="NHD",
                device_type="cuda", sm_count=132, capability=(9, 0))
    p = Problem(**base)
    assert not cute.supports(p) and cute.supports(Problem(**{**base, "head_dim": 128, "v_head_dim": 128}))
    assert Problem(**{**base, "v_head_dim": None}).v_head_dim == 576
    plan = select_plan(p)
    assert (plan.family, plan.block_m, plan.block_n, plan.num_warps) == ("triton", 16, 32, 4) and plan.num_splits > 1
    wide = select_plan(Problem(**{**base, "num_q_heads": 128}))  # 64 query rows a program on sm90 / sm100
    assert (wide.block_m, wide.block_n, wide.num_warps) == (64, 32, 8)
    assert select_plan(Problem(**{**base, "num_q_heads": 128, "capability": (8, 9)})).block_m == 16  # 99 KB
    # partials in out's dtype (bf16: 2 bytes a value) and an fp32 LSE a row and split
    assert plan.scratch_bytes == split_scratch_bytes(p, plan.num_splits) == 8 * 16 * plan.num_splits * (512 * 2 + 4)
    extend = select_plan(Problem(**{**base, "q_len": 300}))
    assert (extend.family, extend.block_m, extend.block_n, extend.num_warps) == ("triton", 32, 16, 8)
    tiles = lambda plan: (plan.family, plan.num_splits, plan.block_m, plan.block_n, plan.num_warps, plan.num_stages)
    nonabsorbed = dict(base, head_dim=192, v_head_dim=128, num_kv_heads=16)
    same_dv = Problem(**dict(nonabsorbed, v_head_dim=192))
    assert tiles(select_plan(Problem(**nonabsorbed))) == tiles(select_plan(same_dv))
    assert select_plan(Problem(**{**base, "device_type": "cpu", "sm_count": 0})).family == "torch"


def _v_in_k(k_cache, v_cache, q):
    from b12x_inductor import validate

    pt = torch.zeros(1, 2, dtype=torch.int32)
    return validate.check_paged_attention(
        q, k_cache, v_cache, pt, torch.tensor([3], dtype=torch.int32), None, kv_layout="NHD", causal=True,
        scale=None, window_left=-1, kv_start=None, sinks=None, softcap=0.0, k_descale=None,
        v_descale=None).v_in_k


def test_problem_knows_when_v_is_k_prefix():
    """Problem.v_in_k: v_cache is k_cache's first Dv columns (the latent cache's view), eagerly from the tensors'
    metadata and in the lowering from Inductor's IR; anything else (a copy, another offset, another tensor) is
    False, so the kernels load V themselves."""
    from b12x_inductor.lowering import paged_attention as lowering

    kv = torch.randn(4, 16, 1, 576)
    q = torch.randn(1, 1, 8, 576)
    assert _v_in_k(kv, kv[..., :512], q)
    assert not _v_in_k(kv, kv[..., :512].clone(), q)
    assert not _v_in_k(kv, kv[..., 64:], q)
    assert not _v_in_k(kv, torch.randn(4, 16, 1, 512), q)
    assert not _v_in_k(kv[1:], kv[:-1, ..., :512], q)  # same storage, another offset
    qs = torch.randn(1, 1, 8, 128)
    both = torch.randn(4, 16, 1, 256)
    assert _v_in_k(both[..., :128], both[..., :128], qs) and not _v_in_k(both[..., :128], both[..., 128:], qs)

    seen = []
    plan_for = lowering.plan_for
    record = lambda problem: (seen.append(problem.v_in_k), plan_for(problem))[1]
    pt = torch.arange(4, dtype=torch.int32).reshape(2, 2)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    q2 = torch.randn(2, 1, 8, 576)
    for v_of, expected in ((lambda kv: kv[..., :512], True), (lambda kv: kv[..., 64:], False),
                           (lambda kv: kv[..., :512] * 1, False)):
        torch._dynamo.reset()
        seen.clear()
        f = lambda q, kv, pt, lens: torch.ops.b12x.paged_attention(q, kv, v_of(kv), pt, lens, scale=0.1)[0]
        from unittest import mock

        with mock.patch.object(lowering, "plan_for", record), torch._inductor.config.patch(fx_graph_cache=False):
            torch.compile(f, fullgraph=True)(q2, kv, pt, lens)  # no cache hit: the lowering must run
        assert seen == [expected], (seen, expected)

    # the serving engine's step: the latent cache written in place, then attended (mla_attention's own view)
    def step(q_nope, q_pe, latent, pt, lens, ckv, kpe, slots):
        b12x.mla_write_kv(ckv, kpe, latent, slots)
        return b12x.mla_attention(q_nope, q_pe, latent, pt, lens, scale=0.1)

    torch._dynamo.reset()
    seen.clear()
    with mock.patch.object(lowering, "plan_for", record), torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(step, fullgraph=True)(q2[..., :512], q2[..., 512:], kv[:, :, 0], pt, lens,
                                            torch.randn(2, 512), torch.randn(2, 64), torch.tensor([19, 40]))
    assert seen == [True], seen


def test_v_from_k_is_refused_where_it_does_not_fit():
    """v_from_k (V's tile from K's) is asked for, never guessed: the Triton plan refuses it where v is not k's
    first Dv columns, or Dv is not K's first column block; a launch refuses a v_cache that is not that view;
    the CuTe family refuses it but for its MLA kernel, which always takes it. select_plan takes it for MLA
    decode/verify exactly where it fits (v_in_k)."""
    from b12x_inductor import kernels
    from b12x_inductor.kernels import triton as tk
    import importlib

    tplan = importlib.import_module("b12x_inductor.kernels.triton.plan")
    from b12x_inductor.plan import Problem, family_plan, select_plan
    from tests.helpers import direct_call

    base = dict(batch=8, q_len=1, packed=False, num_q_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512,
                page_size=64, max_pages=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, kv_layout="NHD",
                device_type="cuda", sm_count=132, capability=(9, 0))
    latent = Problem(**base, v_in_k=True)
    assert family_plan(latent, "triton", v_from_k=True).v_from_k
    assert tplan.v_from_k_fits(latent) and select_plan(latent).v_from_k
    assert not select_plan(Problem(**base)).v_from_k  # a separate v_cache: V loaded on its own
    assert not select_plan(Problem(**{**base, "q_len": 100}, v_in_k=True)).v_from_k  # extend: not measured yet
    with pytest.raises(ValueError, match="v_from_k needs v_cache to be k_cache's first Dv columns"):
        family_plan(Problem(**base), "triton", v_from_k=True)
    with pytest.raises(ValueError, match="v_from_k needs"):  # 192 / 128: K's first block is 256 wide
        family_plan(Problem(**{**base, "head_dim": 192, "v_head_dim": 128}, v_in_k=True), "triton", v_from_k=True)
    with pytest.raises(ValueError, match="other kernels load V themselves; v_from_k=True"):
        kernels.family("cute").plan(Problem(**{**base, "head_dim": 128, "v_head_dim": 128}, v_in_k=True),
                                    v_from_k=True)
    # the CuTe MLA kernel always takes V from K: its plans say so, and cannot be asked to load V
    assert kernels.family("cute").plan(latent).v_from_k
    with pytest.raises(ValueError, match="MLA kernel reads V from K's tiles.*v_from_k=False"):
        kernels.family("cute").plan(latent, v_from_k=False)
    t = make_inputs(d=576, dv=512, hq=4, hkv=1)  # v from the other half: not k's columns
    options = dict(kv_layout="NHD", causal=True, scale=0.05, window_left=-1, softcap=0.0)
    call = direct_call(t, "decode", options, dict(num_splits=1, block_m=16, block_n=16, num_warps=4, num_stages=2,
                                                  v_from_k=True))
    with pytest.raises(ValueError, match="v_cache is not k_cache's first Dv columns"):
        tk.run(call)


# ----------------------------------------------------------------------------------------------------------
# mla_attention


def _latent_inputs(*, q_len=1, packed=False, heads=8, page_size=16, dtype=torch.float32, seed=0):
    """vLLM's latent cache [num_pages, page_size, 576] (unused slots NaN) and absorbed queries."""
    t = make_inputs(d=576, dv=512, hq=heads, hkv=1, v_view=True, q_len=q_len, packed=packed, page_size=page_size,
                    dtype=dtype, nan_unused=True, seed=seed)
    latent = t["k_cache"][:, :, 0]  # [num_pages, page_size, 576], strided (a view of a combined cache)
    return t, latent


def _mla_reference(t, **opts):
    return paged_attention_reference(t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"],
                                     t["cu_seqlens_q"], **opts)


@pytest.mark.parametrize("form", ["split_q", "whole_q", "flashinfer_pair"])
def test_mla_attention_eager(form):
    t, latent = _latent_inputs(q_len=3, seed=5)
    q = t["q"]
    q_nope, q_pe = (q[..., :512], q[..., 512:]) if form != "whole_q" else (q, None)
    kv = latent
    if form == "flashinfer_pair":
        buf = torch.full((latent.shape[0], latent.shape[1], 576), float("nan"))
        buf.copy_(latent)
        kv = (buf[..., :512], buf[..., 512:])
    out, lse = b12x.mla_attention(q_nope, q_pe, kv, t["page_table"], t["cache_seqlens"], scale=0.05,
                                  return_lse=True)
    assert out.shape == q.shape[:-1] + (512,)
    ref_out, ref_lse = _mla_reference(t, scale=0.05)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_mla_attention_out_and_lse_packed():
    t, latent = _latent_inputs(packed=True, seed=6)
    q = t["q"]
    out = torch.full(q.shape[:-1] + (512,), float("nan"))
    got = b12x.mla_attention(q[..., :512], q[..., 512:], latent, t["page_table"], t["cache_seqlens"],
                             t["cu_seqlens_q"], scale=0.05, out=out)
    assert got is out
    ref_out, _ = _mla_reference(t, scale=0.05)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_len", [1, 20])
def test_mla_attention_compiled_fullgraph(q_len):
    """torch.compile(fullgraph=True, Inductor): the query's two parts, the cache views and the op trace; the
    lowering plans D = 576 / Dv = 512 (the torch family on CPU); equal to the reference."""
    t, latent = _latent_inputs(q_len=q_len, heads=4, seed=8)

    def step(q_nope, q_pe, kv, pt, lens):
        out, lse = b12x.mla_attention(q_nope, q_pe, kv, pt, lens, scale=0.05, return_lse=True)
        return out * 2.0, lse

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    q = t["q"]
    out, lse = compiled(q[..., :512].contiguous(), q[..., 512:].contiguous(), latent, t["page_table"],
                        t["cache_seqlens"])
    ref_out, ref_lse = _mla_reference(t, scale=0.05)
    torch.testing.assert_close(out / 2.0, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shape", ["decode", "verify", "packed", "extend"])
def test_paged_attention_reads_q_pe_in_place(shape):
    """paged_attention(q, ..., q_pe=q_pe) is the attention of cat(q, q_pe): q a slice of a wider buffer (its
    other columns NaN) and q_pe a transposed view, both read in place (the torch family; the Triton kernels:
    test_triton_kernels.py's split_q cases, the CuTe kernel: test_mla_gpu.py)."""
    kw = dict(decode=dict(q_len=1), verify=dict(q_len=4), packed=dict(packed=True), extend=dict(q_len=20))[shape]
    t = make_inputs(d=576, dv=512, hq=4, hkv=1, v_view=True, nan_unused=True, split_q=True, sinks=True,
                    dtype=torch.float32, page_size=4, seed=11, **kw)
    assert t["q"].stride(-2) == 640 and not t["q_pe"].is_contiguous()
    out, lse = b12x.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"],
                                    t["cu_seqlens_q"], sinks=t["sinks"], q_pe=t["q_pe"], scale=0.06, return_lse=True)
    ref_out, ref_lse = paged_attention_reference(**t, scale=0.06)
    whole = torch.cat([t["q"], t["q_pe"]], dim=-1)
    ref2_out, _ = paged_attention_reference(**{**t, "q": whole, "q_pe": None}, scale=0.06)
    torch.testing.assert_close(ref_out, ref2_out)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_paged_attention_q_pe_default_scale_is_the_whole_head_dim():
    t = make_inputs(d=576, dv=512, hq=2, hkv=1, v_view=True, split_q=True, dtype=torch.float32, seed=12)
    out = b12x.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["cache_seqlens"],
                               q_pe=t["q_pe"])
    ref_out, _ = paged_attention_reference(**t, scale=576 ** -0.5)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_len", [1, 20])
def test_mla_attention_compiled_passes_q_pe_through(q_len):
    """Under torch.compile (Inductor), mla_attention's query reaches the entry op as two tensors: no cat of q in
    the generated code, q_pe a (non-None) argument of the entry op."""
    from torch._inductor.utils import run_and_get_code

    t, latent = _latent_inputs(q_len=q_len, heads=4, seed=13)

    def step(q_nope, q_pe, kv, pt, lens):
        return b12x.mla_attention(q_nope, q_pe, kv, pt, lens, scale=0.05)

    torch._dynamo.reset()
    q = t["q"]
    q_nope, q_pe = q[..., :512].contiguous(), q[..., 512:].movedim(-2, 0).contiguous().movedim(0, -2)
    out, (code,) = run_and_get_code(torch.compile(step, fullgraph=True), q_nope, q_pe, latent, t["page_table"],
                                    t["cache_seqlens"])
    mode = "decode" if q_len == 1 else "extend"
    calls = [ln for ln in code.splitlines() if f"paged_attention_{mode}.default(" in ln]
    assert len(calls) == 1, code
    args = calls[0].split(".default(", 1)[1].split(", ")
    assert args[11] != "None", calls[0]  # the entry op's q_pe (schema: ..., key_mask, q_pe, out, lse, scratch)
    assert not re.search(r"aten\.cat|_cat_|\bcat\(", code), "the query is concatenated in the generated code"
    ref_out, _ = _mla_reference(t, scale=0.05)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)


def _q_pe_args():
    t = make_inputs(d=576, dv=512, hq=4, hkv=1, v_view=True, split_q=True, dtype=torch.float32, seed=14)
    return dict(q=t["q"], k_cache=t["k_cache"], v_cache=t["v_cache"], page_table=t["page_table"],
                cache_seqlens=t["cache_seqlens"], q_pe=t["q_pe"])


Q_PE_CASES = [
    ("not_mla", lambda a: a.update(make_inputs(d=128, hq=4, hkv=2, dtype=torch.float32) | dict(
        q_pe=torch.randn(2, 1, 4, 64))), ValueError, "q_pe must be None unless k_cache's head dim is absorbed MLA's"),
    ("whole_q_too", lambda a: a.update(q=torch.randn(2, 1, 4, 576)), ValueError,
     r"q_pe must be of shape \(2, 1, 4, 64\) with q of last dim 512"),
    ("q_pe_width", lambda a: a.update(q_pe=a["q_pe"][..., :32]), ValueError, r"q_pe must be of shape \(2, 1, 4, 64\)"),
    ("q_pe_dims", lambda a: a.update(q_pe=a["q_pe"][0]), ValueError, "q_pe must be 4-dimensional"),
    ("q_pe_dtype", lambda a: a.update(q_pe=a["q_pe"].double()), TypeError, "q_pe must be of dtype torch.float32"),
    ("q_pe_last_stride", lambda a: a.update(q_pe=torch.randn(2, 1, 4, 128)[..., ::2]), ValueError,
     "q_pe must be contiguous in its last dim"),
    ("q_pe_type", lambda a: a.update(q_pe=[1.0]), TypeError, "q_pe must be a torch.Tensor or None"),
]


@pytest.mark.parametrize("name,change,exc,message", Q_PE_CASES, ids=[c[0] for c in Q_PE_CASES])
@pytest.mark.parametrize("where", ["eager", "compiled"])
def test_paged_attention_bad_q_pe(name, change, exc, message, where):
    args = _q_pe_args()
    change(args)
    for k in ("cu_seqlens_q", "kv_start", "sinks", "k_descale", "v_descale", "key_mask"):
        args.pop(k, None)
    _raises(_where(b12x.paged_attention, where), exc, "^paged_attention: " + message, **args)


# ----------------------------------------------------------------------------------------------------------
# Bad shapes


def _mla_args():
    t, latent = _latent_inputs(q_len=1, heads=4, seed=9)
    q = t["q"]
    return dict(q_nope=q[..., :512], q_pe=q[..., 512:], kv_cache=latent, page_table=t["page_table"],
                cache_seqlens=t["cache_seqlens"], scale=0.05)


def _set(**changes):
    def f(args):
        for k, val in changes.items():
            args[k] = val(args) if callable(val) else val
    return f


MLA_CASES = [
    ("q_pe_shape", _set(q_pe=lambda a: a["q_pe"][..., :32]), ValueError, r"q_pe must be of shape \(2, 1, 4, 64\)"),
    ("q_pe_dtype", _set(q_pe=lambda a: a["q_pe"].double()), TypeError, "q_pe must be of q_nope's dtype"),
    ("q_nope_dim", _set(q_nope=lambda a: a["q_nope"][..., :256]), ValueError,
     "q_nope must be of last dim kv_lora_rank = 512"),
    ("whole_q_dim", _set(q_pe=None), ValueError, r"q_nope must be of last dim kv_lora_rank \+ rope_dim = 576"),
    ("q_nope_5d", _set(q_nope=lambda a: a["q_nope"][None], q_pe=lambda a: a["q_pe"][None]), ValueError,
     r"q_nope must be \[B, S, H, kv_lora_rank\]"),
    ("kv_cache_dims", _set(kv_cache=lambda a: a["kv_cache"][:, :, None]), ValueError,
     "kv_cache must be 3-dimensional"),
    ("kv_cache_narrow", _set(kv_cache=lambda a: a["kv_cache"][..., :512]), ValueError,
     "kv_cache must be wider than kv_lora_rank = 512"),
    ("kv_cache_type", _set(kv_cache=[1, 2, 3]), ValueError, r"kv_cache must be a tensor or a pair \(ckv, kpe\)"),
    ("scale_none", _set(scale=None), TypeError, "scale must be a Python float"),
    ("kv_lora_rank", _set(kv_lora_rank=0), ValueError, "kv_lora_rank must be a positive int"),
    ("rank_576", _set(kv_lora_rank=448, q_nope=lambda a: torch.randn(2, 1, 4, 448), q_pe=lambda a: torch.randn(
        2, 1, 4, 128)), ValueError, "paged_attention: v_cache must be of value head dim 512 with q/k head dim 576"),
]


@pytest.mark.parametrize("name,change,exc,message", MLA_CASES, ids=[c[0] for c in MLA_CASES])
@pytest.mark.parametrize("where", ["eager", "compiled"])
def test_mla_attention_bad_input(name, change, exc, message, where):
    args = _mla_args()
    change(args)
    _raises(_where(b12x.mla_attention, where), exc, message, **args)


def test_mla_attention_scale_is_required():
    args = _mla_args()
    del args["scale"]
    with pytest.raises(TypeError, match="scale"):
        b12x.mla_attention(**args)


def test_flashinfer_pair_must_be_adjacent_views():
    args = _mla_args()
    latent = args["kv_cache"]
    ckv, kpe = latent[..., :512], latent[..., 512:]
    assert b12x.mla.latent_cache(ckv, kpe).data_ptr() == latent.data_ptr()
    for name, pair, message in [
        ("separate buffers", (ckv.contiguous(), kpe.contiguous()), r"kv_cache must be \(ckv, kpe\) adjacent views"),
        ("swapped", (latent[..., 64:], latent[..., :64]), r"kv_cache must be \(ckv, kpe\) adjacent views"),
        ("overlapping", (latent[..., 1:513], latent[..., 512:]), r"kv_cache must be \(ckv, kpe\) adjacent views"),
        ("other buffer", (torch.randn(latent.shape[0], 2, *latent.shape[1:])[:, 0, :, :512], kpe),
         r"kv_cache must be \(ckv, kpe\) adjacent views"),
        ("pages", (ckv, kpe[:-1]), r"kv_cache\[1\] \(kpe\) must be of ckv's \[num_pages, page_size\]"),
        ("rank", (latent[..., :448], latent[..., 448:]), r"kv_cache\[0\] \(ckv\) must be of last dim kv_lora_rank"),
    ]:
        with pytest.raises(ValueError, match=message):
            b12x.mla_attention(args["q_nope"], args["q_pe"], pair, args["page_table"], args["cache_seqlens"],
                               scale=0.05)
    # under torch.compile the pair is refused (Dynamo cannot read data pointers): pass the view
    torch._dynamo.reset()
    fn = torch.compile(b12x.mla_attention, fullgraph=True, backend="eager")
    _raises(fn, ValueError, "kv_cache must be one .* tensor under torch.compile", q_nope=args["q_nope"],
            q_pe=args["q_pe"], kv_cache=(ckv, kpe), page_table=args["page_table"],
            cache_seqlens=args["cache_seqlens"], scale=0.05)


def test_mla_attention_keeps_inputs():
    """No input changes (q_nope, q_pe and the cache are only read)."""
    args = _mla_args()
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    b12x.mla_attention(**args)
    for k, v in before.items():
        torch.testing.assert_close(args[k], v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_write_kv_dv(kv_layout):
    """write_kv takes v [N, Hkv, Dv] into a v_cache of head dim Dv (non-absorbed MLA's 192 / 128), as the
    reference writes it, duplicates and skipped slots included."""
    from b12x_inductor.kernels.reference import write_kv_reference

    gen = torch.Generator().manual_seed(4)
    shape = (5, 4, 2) if kv_layout == "NHD" else (5, 2, 4)
    k_cache, v_cache = torch.randn(*shape, 192, generator=gen), torch.randn(*shape, 128, generator=gen)
    k, v = torch.randn(6, 2, 192, generator=gen), torch.randn(6, 2, 128, generator=gen)
    slots = torch.tensor([3, -1, 17, 3, 0, 19])
    ek, ev = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, ek, ev, slots, kv_layout=kv_layout)
    b12x.write_kv(k, v, k_cache, v_cache, slots, kv_layout=kv_layout)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)
    page, off = 17 // 4, 17 % 4
    assert torch.equal(v_cache[page, off] if kv_layout == "NHD" else v_cache[page, :, off], v[2])


# ----------------------------------------------------------------------------------------------------------
# mla_write_kv: the latent cache's write (b12x::write_latent)


def _new_latents(num, *, dtype=torch.float32, seed=0, rank=RANK, rope=ROPE):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num, rank, generator=gen).to(dtype), torch.randn(num, rope, generator=gen).to(dtype))


def _nan_cache(num_pages, page_size, *, dtype=torch.float32, strided=False):
    """A latent cache [num_pages, page_size, 576] of NaN (unwritten memory); strided: a view of a wider buffer
    (padded page and slot strides, the last dim contiguous)."""
    if strided:
        return torch.full((num_pages, page_size, RANK + ROPE + 40), float("nan"), dtype=dtype)[..., :RANK + ROPE]
    return torch.full((num_pages, page_size, RANK + ROPE), float("nan"), dtype=dtype)


def _slots(num_slots, slot_dtype, seed):
    """Slots of 12 tokens: 8 distinct kept slots in random order, two padding tokens (-1, and -7 as any negative
    slot), a duplicate of a kept slot (the later token wins) and one past the cache (skipped: a 64-bit 2**40 for
    int64, 2**31 - 1 for int32)."""
    gen = torch.Generator().manual_seed(seed)
    kept = torch.randperm(num_slots, generator=gen)[:8].tolist()
    far = 2**40 if slot_dtype == torch.int64 else 2**31 - 1
    return torch.tensor(kept[:3] + [-1] + kept[3:6] + [far, kept[1], -7] + kept[6:], dtype=slot_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mla_write_kv_matches_reference(page_size, slot_dtype, strided, dtype):
    """Fresh random latents into a NaN cache of their dtype: equal to write_latent_reference bit for bit, each
    kept token's slot row is cat(ckv[t], kpe[t]) (the later of a duplicate pair), and every other slot is still
    NaN."""
    from b12x_inductor.kernels.reference import write_latent_reference

    num_pages = max(2, 24 // page_size)
    cache = _nan_cache(num_pages, page_size, dtype=dtype, strided=strided)
    slots = _slots(num_pages * page_size, slot_dtype, seed=page_size)
    ckv, kpe = _new_latents(len(slots), dtype=dtype, seed=page_size + 1)
    expected = cache.clone()
    write_latent_reference(ckv, kpe, expected, slots)
    b12x.mla_write_kv(ckv, kpe, cache, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    written = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for slot in slots.tolist():
        if 0 <= slot < num_pages * page_size:
            last = max(i for i, s in enumerate(slots.tolist()) if s == slot)
            assert torch.equal(cache[slot // page_size, slot % page_size], torch.cat([ckv[last], kpe[last]]))
            written[slot] = True
    assert int(written.sum()) == 8
    flat = cache.reshape(-1, RANK + ROPE)
    assert flat[written].isfinite().all() and flat[~written].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_write_kv_fp8_scale(dtype):
    """A float8_e4m3fn cache stores value / scale, saturated to +-448 (as write_kv's k_scale), equal to the
    reference; untouched slots stay NaN; mla_attention reads it back with k_descale=scale, close to attention
    over a cache of the unquantized latents."""
    from b12x_inductor.kernels.reference import write_latent_reference

    cache = _nan_cache(3, 16, dtype=torch.float8_e4m3fn)
    slots = _slots(48, torch.int64, seed=3)
    ckv, kpe = _new_latents(len(slots), dtype=dtype, seed=4)
    ckv[0, 0], kpe[2, 5] = 1000.0, -1000.0  # past 448 * scale: saturated
    scale = torch.tensor(0.37)
    expected = cache.clone()
    write_latent_reference(ckv, kpe, expected, slots, scale=scale)
    b12x.mla_write_kv(ckv, kpe, cache, slots, scale=scale)
    torch.testing.assert_close(cache.float(), expected.float(), rtol=0, atol=0, equal_nan=True)
    row = cache[int(slots[0]) // 16, int(slots[0]) % 16].float()
    assert row[0] == 448.0 and cache[int(slots[2]) // 16, int(slots[2]) % 16, RANK + 5].float() == -448.0
    latent = torch.cat([ckv, kpe], dim=1).float()
    torch.testing.assert_close(row[1:] * 0.37, latent[0, 1:], rtol=2 ** -3, atol=0.37 * 2 ** -6)
    assert int(cache.float().isnan().reshape(48, -1).all(1).sum()) == 48 - 8

    # read back: 8 new tokens (none saturated) in a fresh float8 cache, attended with k_descale=scale, are close
    # to the same tokens attended unquantized (and far from them without the descale)
    ckv, kpe = _new_latents(8, dtype=dtype, seed=6)
    fp8, plain = _nan_cache(1, 16, dtype=torch.float8_e4m3fn), _nan_cache(1, 16)
    b12x.mla_write_kv(ckv, kpe, fp8, torch.arange(8), scale=scale)
    b12x.mla_write_kv(ckv.float(), kpe.float(), plain, torch.arange(8))
    q = torch.randn(1, 1, 4, RANK + ROPE, generator=torch.Generator().manual_seed(5)).to(dtype)
    args = dict(page_table=torch.zeros(1, 1, dtype=torch.int32), cache_seqlens=torch.tensor([8], dtype=torch.int32),
                scale=0.05)
    want = b12x.mla_attention(q.float(), None, plain, **args)
    got = b12x.mla_attention(q, None, fp8, **args, k_descale=scale).float()
    torch.testing.assert_close(got, want, rtol=0, atol=0.15)  # float8: 3 mantissa bits
    assert (b12x.mla_attention(q, None, fp8, **args).float() - want).abs().max() > 0.5


@pytest.mark.parametrize("q_len", [1, 3])
def test_mla_write_kv_then_attend_compiled(q_len):
    """torch.compile(fullgraph=True, Inductor) of write-then-attend: the write is functionalized, so the
    attention of the same graph reads the new tokens (their slots hold NaN before: a read before the write
    shows as NaN), equal to eager; the caller's cache (a strided view) is written in place, no copy of it."""
    from torch._inductor.utils import run_and_get_code

    t, latent = _latent_inputs(q_len=q_len, heads=4, seed=8)
    page_table, lens = t["page_table"], t["cache_seqlens"]
    page_size = latent.shape[1]
    positions = [(b, j) for b in range(len(lens)) for j in range(int(lens[b]) - q_len, int(lens[b]))]
    slots = torch.tensor([int(page_table[b, j // page_size]) * page_size + j % page_size for b, j in positions])
    cache = latent.clone()
    cache.view(-1, RANK + ROPE)[slots] = float("nan")  # the new tokens' slots: unwritten
    ckv, kpe = _new_latents(len(slots), seed=q_len)
    q = t["q"]
    q_nope, q_pe = q[..., :RANK].contiguous(), q[..., RANK:].contiguous()

    def step(ckv, kpe, kv_cache, slots, q_nope, q_pe, page_table, lens):
        b12x.mla_write_kv(ckv, kpe, kv_cache, slots)
        return b12x.mla_attention(q_nope, q_pe, kv_cache, page_table, lens, scale=0.05)

    eager_cache = cache.clone()
    expected = step(ckv, kpe, eager_cache, slots, q_nope, q_pe, page_table, lens)
    assert expected.isfinite().all()
    ref, _ = paged_attention_reference(q, eager_cache[:, :, None], eager_cache[:, :, None, :RANK], page_table, lens,
                                       scale=0.05)
    torch.testing.assert_close(expected, ref, atol=2e-5, rtol=2e-5)

    buf = torch.full((cache.shape[0], page_size, RANK + ROPE + 64), float("nan"))
    compiled_cache = buf[..., :RANK + ROPE]
    compiled_cache.copy_(cache)
    torch._dynamo.reset()
    out, (code,) = run_and_get_code(torch.compile(step, fullgraph=True), ckv, kpe, compiled_cache, slots, q_nope,
                                    q_pe, page_table, lens)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(compiled_cache, eager_cache, rtol=0, atol=0, equal_nan=True)
    assert buf[..., RANK + ROPE:].isnan().all()
    assert "torch.ops.b12x.write_latent.default(" in code
    for copy in ("clone", ".copy_(", "aten.copy"):
        assert copy not in code, f"generated code copies the cache: {copy}"


@pytest.mark.parametrize("where", ["eager", "compiled"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_write_kv_decode_loop(page_size, where):
    """A decode loop over 3 requests: a packed prefill write of their prompts, then 5 steps that each write one
    token per request (and a padding token with slot -1, as a batch padded for a CUDA graph) and attend. Every
    step equals mla_attention over a cache built by hand (slot rows assigned directly), bit for bit, and the
    two caches stay equal, NaN where nothing was written."""
    gen = torch.Generator().manual_seed(page_size)
    prompts, steps, heads = [5, 17, 1], 5, 4
    max_pages = -(-(max(prompts) + steps) // page_size) + 1
    num_pages = 3 * max_pages + 2
    page_table = torch.randperm(num_pages, generator=gen)[: 3 * max_pages].reshape(3, max_pages).int()
    cache, by_hand = _nan_cache(num_pages, page_size), _nan_cache(num_pages, page_size)

    def slot_of(b, j):
        return int(page_table[b, j // page_size]) * page_size + j % page_size

    def attend(q_nope, q_pe, kv_cache, lens):
        return b12x.mla_attention(q_nope, q_pe, kv_cache, page_table, lens, scale=SCALE)

    def step(ckv, kpe, slots, q_nope, q_pe, lens):
        b12x.mla_write_kv(ckv, kpe, cache, slots)
        return attend(q_nope, q_pe, cache, lens)

    if where == "compiled":
        torch._dynamo.reset()
        step = torch.compile(step, fullgraph=True, dynamic=False)
    prompt_slots = [slot_of(b, j) for b, n in enumerate(prompts) for j in range(n)]
    ckv, kpe = _new_latents(len(prompt_slots), seed=99)
    b12x.mla_write_kv(ckv, kpe, cache, torch.tensor(prompt_slots))
    for t, slot in enumerate(prompt_slots):
        by_hand[slot // page_size, slot % page_size] = torch.cat([ckv[t], kpe[t]])
    lens = list(prompts)
    for i in range(steps):
        ckv, kpe = _new_latents(4, seed=i)
        slots = [slot_of(b, lens[b]) for b in range(3)]
        for b, slot in enumerate(slots):
            by_hand[slot // page_size, slot % page_size] = torch.cat([ckv[b], kpe[b]])
        lens = [n + 1 for n in lens]
        seqlens = torch.tensor(lens, dtype=torch.int32)
        q_nope = torch.randn(3, 1, heads, RANK, generator=gen)
        q_pe = torch.randn(3, 1, heads, ROPE, generator=gen)
        out = step(ckv, kpe, torch.tensor(slots + [-1]), q_nope, q_pe, seqlens)
        assert out.isfinite().all()
        torch.testing.assert_close(out, attend(q_nope, q_pe, by_hand, seqlens), rtol=0, atol=0)
        torch.testing.assert_close(cache, by_hand, rtol=0, atol=0, equal_nan=True)
    live = sum(lens)
    assert int(cache.reshape(-1, RANK + ROPE).isfinite().all(1).sum()) == live


def test_mla_write_kv_out_of_range_slots_under_debug(monkeypatch):
    """As write_kv: a slot past the cache is skipped without B12X_DEBUG and raises with B12X_DEBUG=1."""
    ckv, kpe = _new_latents(2)
    cache = torch.zeros(5, 4, RANK + ROPE)
    slots = torch.tensor([3, 20], dtype=torch.int32)
    b12x.mla_write_kv(ckv, kpe, cache, slots)
    assert torch.equal(cache[0, 3], torch.cat([ckv[0], kpe[0]])) and int(cache.ne(0).any(-1).sum()) == 1
    monkeypatch.setenv("B12X_DEBUG", "1")
    with pytest.raises(ValueError, match=r"^write_latent: slot_mapping must be slots < num_pages \* page_size = 20"):
        b12x.mla_write_kv(ckv, kpe, cache, slots)


def test_mla_write_kv_cuda_path_never_reads_device_values_on_the_host():
    """write_latent_torch (what the op runs on CUDA too, inside CUDA graphs) with duplicate, skipped and
    out-of-range slots: no host read of a device value (under FakeTensorMode one would raise)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from b12x_inductor.kernels.torch_impl import write_latent_torch

    with FakeTensorMode(allow_non_fake_inputs=True):
        ckv, kpe = torch.randn(5, RANK), torch.randn(5, ROPE)
        write_latent_torch(ckv, kpe, torch.randn(4, 16, RANK + ROPE), torch.tensor([7, -1, 7, 10**9, 3]), scale=None)
        write_latent_torch(ckv.bfloat16(), kpe.bfloat16(), torch.empty(4, 16, RANK + ROPE, dtype=torch.float8_e4m3fn),
                           torch.tensor([7, -1, 7, 10**9, 3], dtype=torch.int32), scale=torch.tensor(0.5))


def test_mla_write_kv_grad_and_opcheck():
    """No backward (as write_kv): an input that requires grad is refused with grad mode on, fine under no_grad;
    torch.library.opcheck passes (schema with its mutation, fake, autograd registration, AOT dispatch)."""
    ckv, kpe = _new_latents(3)
    cache = torch.zeros(5, 4, RANK + ROPE)
    slots = torch.tensor([0, 9, -1])
    with pytest.raises(RuntimeError, match="write_latent: ckv requires grad with grad mode on"):
        b12x.mla_write_kv(ckv.clone().requires_grad_(), kpe, cache, slots)
    with torch.no_grad():
        b12x.mla_write_kv(ckv.clone().requires_grad_(), kpe, cache, slots)
    assert torch.equal(cache[2, 1], torch.cat([ckv[1], kpe[1]])) and not cache.requires_grad
    op = torch.ops.b12x.write_latent.default
    torch.library.opcheck(op, (ckv, kpe, torch.randn(5, 4, RANK + ROPE), slots))
    torch.library.opcheck(op, (ckv.bfloat16(), kpe.bfloat16(), torch.randn(5, 4, RANK + ROPE).bfloat16(),
                               slots.int()))


def _write_latent_args():
    ckv, kpe = _new_latents(3)
    return dict(ckv=ckv, kpe=kpe, kv_cache=torch.zeros(5, 4, RANK + ROPE), slot_mapping=torch.tensor([0, 1, 2]))


_FP8 = dict(ckv=lambda a: a["ckv"].bfloat16(), kpe=lambda a: a["kpe"].bfloat16(),
            kv_cache=lambda a: a["kv_cache"].to(torch.float8_e4m3fn))
WRITE_LATENT_CASES = [
    ("ckv_dims", _set(ckv=lambda a: a["ckv"][None]), ValueError, "ckv must be 2-dimensional"),
    ("ckv_dtype", _set(ckv=lambda a: a["ckv"].double()), TypeError,
     "ckv must be of dtype torch.bfloat16, torch.float16 or torch.float32; got torch.float64"),
    ("ckv_width", _set(ckv=lambda a: torch.randn(3, 576)), ValueError,
     r"ckv must be of shape \[T, kv_lora_rank\] with 0 < kv_lora_rank < 576 .*; got shape \(3, 576\)"),
    ("kpe_width", _set(kpe=lambda a: a["kpe"][:, :32]), ValueError,
     r"kpe must be of shape \[T, rope_dim\] = \(3, 64\) .*; got shape \(3, 32\)"),
    ("kpe_tokens", _set(kpe=lambda a: torch.randn(4, 64)), ValueError,
     r"kpe must be of shape \[T, rope_dim\] = \(3, 64\) .*; got shape \(4, 64\)"),
    ("kpe_dtype", _set(kpe=lambda a: a["kpe"].half()), TypeError, "kpe must be of ckv's dtype torch.float32"),
    ("cache_width", _set(kv_cache=lambda a: torch.zeros(5, 4, 520)), ValueError,
     r"kpe must be of shape \[T, rope_dim\] = \(3, 8\) \(ckv's T; rope_dim = kv_cache's last dim 520"),
    ("cache_dims", _set(kv_cache=lambda a: a["kv_cache"][:, :, None]), ValueError, "kv_cache must be 3-dimensional"),
    ("cache_stride", _set(kv_cache=lambda a: torch.zeros(5, 576, 4).transpose(1, 2)), ValueError,
     r"kv_cache must be contiguous in its last dim; got strides \(2304, 1, 4\)"),
    ("cache_pages", _set(kv_cache=lambda a: a["kv_cache"][:0]), ValueError,
     r"kv_cache must be a cache with at least one page .*; got shape \(0, 4, 576\)"),
    ("cache_dtype", _set(kv_cache=lambda a: a["kv_cache"].half()), TypeError,
     "kv_cache must be of ckv's dtype torch.float32 or torch.float8_e4m3fn"),
    ("fp8_with_fp32", _set(kv_cache=_FP8["kv_cache"], scale=torch.tensor(1.0)), TypeError,
     r"kv_cache must be .* \(with bf16/fp16 ckv\); got torch.float8_e4m3fn"),
    ("cache_list", _set(kv_cache=[0.0]), TypeError, "kv_cache must be a torch.Tensor; got list"),
    ("slots_dtype", _set(slot_mapping=lambda a: a["slot_mapping"].short()), TypeError,
     "slot_mapping must be of dtype torch.int64 or torch.int32; got torch.int16"),
    ("slots_float", _set(slot_mapping=lambda a: a["slot_mapping"].float()), TypeError,
     "slot_mapping must be of dtype torch.int64 or torch.int32"),
    ("slots_shape", _set(slot_mapping=lambda a: a["slot_mapping"][:2]), ValueError,
     r"slot_mapping must be of shape \(3,\); got shape \(2,\)"),
    ("slots_list", _set(slot_mapping=[0, 1, 2]), TypeError, "slot_mapping must be a torch.Tensor; got list"),
    ("scale_not_fp8", _set(scale=torch.tensor(0.5)), ValueError,
     "scale must be None for a cache that is not float8_e4m3fn"),
    ("scale_missing", _set(**_FP8), ValueError,
     r"scale must be a float32 scalar tensor for a float8_e4m3fn kv_cache .*; got None"),
    ("scale_shape", _set(**_FP8, scale=torch.ones(3)), ValueError,
     r"scale must be a float32 scalar tensor \(shape \(\)\); got shape \(3,\)"),
    ("scale_dtype", _set(**_FP8, scale=torch.tensor(0.5, dtype=torch.float64)), TypeError,
     "scale must be of dtype torch.float32; got torch.float64"),
    ("scale_float", _set(**_FP8, scale=0.5), TypeError, "scale must be a torch.Tensor or None; got float 0.5"),
]


@pytest.mark.parametrize("name,change,exc,message", WRITE_LATENT_CASES, ids=[c[0] for c in WRITE_LATENT_CASES])
@pytest.mark.parametrize("where", ["eager", "compiled"])
def test_mla_write_kv_bad_input(name, change, exc, message, where):
    args = _write_latent_args()
    change(args)
    _raises(_where(b12x.mla_write_kv, where), exc, "^write_latent: " + message, **args)


def test_mla_write_kv_good_input_runs_in_every_where():
    """The bad-input cases mean something only if the unchanged call (and its fp8 form) runs eagerly and compiled."""
    for fp8 in (False, True):
        for where in ("eager", "compiled"):
            args = _write_latent_args()
            if fp8:
                _set(**_FP8, scale=torch.tensor(0.5))(args)
            _where(b12x.mla_write_kv, where)(**args)
            assert args["kv_cache"][0, :3].float().ne(0).any(), (fp8, where)


# ---- transformers' DeepSeek-V3 (non-absorbed: q/k head dim 192, v head dim 128) ----

@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_deepseek_v3_tokens_equal_eager(cache):
    """A tiny DeepSeek-V3 (MLA with q/k head dim 128 + 64 rope = 192 and v head dim 128, a small MoE) generates
    the same greedy tokens with attn_implementation="b12x" as with eager attention, on a left-padded batch,
    and every attention call ran on the b12x op (2 layers x (prefill + 5 decode steps))."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM

    import b12x_inductor.integrations.hf  # noqa: F401  (registers "b12x")

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=256, n_group=1, topk_group=1,
        rope_scaling=None, initializer_range=0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 256, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False,
              **({"cache_implementation": "static"} if cache == "static" else {}))

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func.namespace == "b12x"
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        eager = model.generate(ids, **kw)
        model.set_attn_implementation("b12x")
        with Count():
            ours = model.generate(ids, **kw)
    assert torch.equal(ours, eager), (ours, eager)
    assert Count.calls == 2 * 6, Count.calls
